"""One step's scheduling decisions as the scheduler makes them (core/scheduler.py): what each request was given."""

from __future__ import annotations

from batchserve.core.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from batchserve.core.prefill_limits import PrefillLimits
from batchserve.request import Request


class StepBuilder:
    """Accumulates one step's decisions: the SchedulerOutput being built, the budget left and the counts the
    statistics read."""

    def __init__(self, token_budget: int, limits: PrefillLimits) -> None:
        self.token_budget = token_budget
        self.limits = limits
        self.output = SchedulerOutput()
        self.num_preempted = 0
        self.num_blocked = 0  # running requests that wait for blocks because only pinned requests could give them
        self.num_prefill_tokens = 0
        self.scheduled: dict[str, tuple[int, bool]] = {}

    def add(self, request: Request, num_tokens: int, new_block_ids: list[int], resumed: bool) -> None:
        if resumed:
            self.output.new_requests.append(
                NewRequestData(
                    req_id=request.request_id,
                    token_ids=request.all_token_ids,
                    num_prompt_tokens=request.num_prompt_tokens,
                    sampling_params=request.sampling_params,
                    block_ids=new_block_ids,
                    num_computed_tokens=request.num_computed_tokens,
                    lora_id=request.lora_id,
                )
            )
        else:
            self.output.cached_requests.append(
                CachedRequestData(request.request_id, new_block_ids, request.num_computed_tokens)
            )
        self.output.num_scheduled_tokens[request.request_id] = num_tokens
        self.token_budget -= num_tokens
        # a chunk is prefill while it computes known tokens beyond the one most recently sampled
        is_prefill = request.num_tokens - request.num_computed_tokens > 1
        if is_prefill:
            self.num_prefill_tokens += num_tokens
        self.scheduled[request.request_id] = (num_tokens, is_prefill)

    def add_padding(self, request: Request) -> None:
        """One token of wasted compute: the finished request's last computed position again."""
        self.output.cached_requests.append(CachedRequestData(request.request_id, [], request.num_computed_tokens - 1))
        self.output.num_scheduled_tokens[request.request_id] = 1
        self.output.padding_req_ids.add(request.request_id)
        self.token_budget -= 1

    @property
    def num_seqs(self) -> int:
        return len(self.output.num_scheduled_tokens)
