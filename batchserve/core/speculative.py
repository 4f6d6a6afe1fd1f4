"""Speculative decoding on the scheduler's side: model-free proposals (n-gram prompt lookup), the draft model's
(computed by the worker after a step, kept here for the next), and the plan of how many tokens a decode sequence
speculates this step (k by load, per-request eligibility). No torch here: proposals
are plain token ids, verified by the worker (worker/speculative.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from batchserve.config import SpeculativeConfig
from batchserve.core.speculation_cost import PRIOR_ACCEPTANCE, StepCostModel, best_k
from batchserve.core.suffix_proposer import SuffixProposer
from batchserve.request import Request
from batchserve.sampling_params import SamplingParams

ACCEPTANCE_WEIGHT = 0.05  # of each verification in the running acceptance estimate


class NgramProposer:
    """Prompt lookup: find the most recent earlier occurrence of the sequence's last n tokens (n from max_n down to
    min_n) in prompt + output, and propose the tokens that followed it."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        length = len(tokens)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            suffix = list(tokens[length - n :])
            first = suffix[0]
            # scan right to left: the most recent match predicts best; the suffix itself (start = length - n) is
            # excluded, so a match always has at least one following token
            for start in range(length - n - 1, -1, -1):
                if tokens[start] == first and list(tokens[start : start + n]) == suffix:
                    return list(tokens[start + n : start + n + k])
        return []


@dataclass
class SpeculationStats:
    """Since start: draft tokens proposed and accepted, verification steps, and the tokens each step produced."""

    num_proposed: int = 0
    num_accepted: int = 0
    num_verify_steps: int = 0
    num_emitted: int = 0  # accepted drafts + one target token per verification step

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted / self.num_proposed if self.num_proposed else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        return self.num_emitted / self.num_verify_steps if self.num_verify_steps else 0.0

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.num_proposed += num_proposed
        self.num_accepted += num_accepted
        self.num_verify_steps += 1
        self.num_emitted += num_accepted + 1


class SpeculationPlanner:
    """Draft tokens for one decode sequence this step, or none. k is 0 from disable_by_batch_size on (a large batch is
    compute-bound and verifying drafts would cost throughput); below it, k_policy "ramp" shrinks k linearly toward
    that size, "cost" picks the k that emits the most tokens per second by the measured step cost
    (core/speculation_cost.py)."""

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self.step_cost = StepCostModel()
        self._fit: tuple[float, float] | None = None  # (fixed, per-token seconds) under k_policy "cost"
        self.acceptance = PRIOR_ACCEPTANCE  # recent verifications' share of drafts kept (exponentially weighted)
        self.proposer = NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
        self.suffix = None
        if config.method == "suffix":
            self.suffix = SuffixProposer(
                config.suffix_decoding_max_tree_depth,
                config.suffix_decoding_min_token_prob,
                config.suffix_decoding_max_cached_requests,
            )
        self.stats = SpeculationStats()
        # method draft_model: req_id -> (the request's token count they follow, the draft model's proposal)
        self.model_drafts: dict[str, tuple[int, list[int]]] = {}

    def k_for_load(self, num_running: int) -> int:
        limit, max_k = self.config.disable_by_batch_size, self.config.num_speculative_tokens
        if num_running >= limit:
            return 0
        if self._fit is not None:
            return best_k(max(num_running, 1), self.acceptance, max_k, *self._fit)
        return -(-max_k * (limit - num_running) // limit)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A forward pass of num_tokens tokens took `seconds` (the engine's measurement, for k_policy "cost")."""
        self.step_cost.observe(num_tokens, seconds)
        if self.config.k_policy == "cost":  # fitted once a step, not once per decode that asks for k
            self._fit = self.step_cost.coefficients()

    def num_model_drafts(self, num_running: int) -> int:
        """Tokens the draft model proposes after a step for the next one (0 unless the method is draft_model)."""
        return self.k_for_load(num_running) if self.config.method == "draft_model" else 0

    def keep_model_drafts(self, drafts: dict[str, list[int]], requests: dict[str, Request]) -> None:
        """The worker's draft-model proposals of a step, each valid only while its request has these tokens."""
        for req_id, tokens in drafts.items():
            request = requests.get(req_id)
            if request is not None and not request.is_finished:
                self.model_drafts[req_id] = (request.num_tokens, tokens)

    def record(self, num_proposed: int, num_accepted: int) -> None:
        self.stats.record(num_proposed, num_accepted)
        if num_proposed:
            self.acceptance += ACCEPTANCE_WEIGHT * (num_accepted / num_proposed - self.acceptance)

    def propose(self, request: Request, num_running: int, token_budget: int, max_model_len: int) -> list[int]:
        if not eligible(request):
            return []
        params = request.sampling_params
        k = min(
            self.k_for_load(num_running),
            token_budget - 1,
            params.max_tokens - request.num_output_tokens - 1,  # the verified step also yields one target token
            max_model_len - request.num_tokens - 1,
        )
        if k <= 0:
            return []
        if self.config.method == "draft_model":
            num_tokens, drafts = self.model_drafts.pop(request.request_id, (-1, []))
            return drafts[:k] if num_tokens == request.num_tokens else []  # stale after a preemption
        if self.suffix is not None:
            return self.suffix.propose_for(request.request_id, request.all_token_ids, k)
        return self.proposer.propose(request.all_token_ids, k)

    def finished(self, request: Request) -> None:
        self.model_drafts.pop(request.request_id, None)
        if self.suffix is not None:
            self.suffix.finished(request.request_id, request.output_token_ids)


def eligible(request: Request) -> bool:
    """Requests whose outputs speculation would change in form are never speculated: logprobs (one record per
    token), prompt logprobs, structured outputs (grammar state per draft), and those that opt out."""
    return speculates(request.sampling_params)


def speculates(params: SamplingParams) -> bool:
    """eligible() on the sampling parameters alone (what the worker knows of a request)."""
    if not params.speculate:
        return False
    if params.logprobs is not None or params.prompt_logprobs is not None:
        return False
    return params.structured_outputs is None
