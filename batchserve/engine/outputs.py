"""What the engine hands back per step and request (CompletionDelta: only what that step added, with the counts
so far), and a request's whole output folded from its deltas (Completion) for the callers that want all of it."""

from __future__ import annotations

from dataclasses import dataclass, field

from batchserve.core.outputs import Logprobs
from batchserve.request import EngineRequest


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    ttft_slo_s: float | None = None  # the targets the request was served against (its own or the server's)
    tpot_slo_s: float | None = None

    def slo_met(self, num_output_tokens: int) -> bool | None:
        """Whether a finished request met its targets; None when it had none. A request that never produced a
        token missed its TTFT target; TPOT is undefined (so met) with a single output token."""
        if self.ttft_slo_s is None and self.tpot_slo_s is None:
            return None
        if self.first_token_time is None:
            return False
        if self.ttft_slo_s is not None and self.first_token_time - self.arrival_time > self.ttft_slo_s:
            return False
        if self.tpot_slo_s is None or num_output_tokens <= 1 or self.finished_time is None:
            return True
        return (self.finished_time - self.first_token_time) / (num_output_tokens - 1) <= self.tpot_slo_s


@dataclass
class CompletionDelta:
    """One request's progress in one step: the tokens, text and logprobs it gained since its last delta. Nothing
    here grows with the request but the counts, so a step's outputs cost the same at token 10 and at token 10,000
    (and a Ray replica sends no more than that)."""

    request_id: str
    delta_token_ids: list[int]
    delta_text: str
    delta_logprobs: list[Logprobs] | None  # None: the request asked for no logprobs
    num_prompt_tokens: int
    num_output_tokens: int  # every token generated so far, this step's included
    finished: bool
    finish_reason: str | None
    stop_reason: int | str | None
    metrics: RequestMetrics
    prompt_logprobs: list[Logprobs | None] | None = None  # once, on the first delta, when the request asked
    pooled: object | None = None  # a pooling request's final delta: its embedding or scores (a float32 tensor)
    lora_name: str | None = None  # the adapter the request runs with (None: the base model)


@dataclass
class Completion:
    """A request's output so far, folded from its deltas in order: what the offline API returns (vLLM's shape:
    `.text`, `.token_ids`, `.outputs[0].text`) and what a front end answering at once reads."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    logprobs: list[Logprobs] | None = None
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0  # of the sampled tokens, when logprobs were asked for
    finished: bool = False
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    metrics: RequestMetrics | None = None
    prompt_logprobs: list[Logprobs | None] | None = None  # a score per prompt token, None for the first
    pooled: object | None = None  # a pooling request's embedding or scores (a float32 tensor), once finished
    _pieces: list[str] = field(default_factory=list, repr=False)  # text, joined when read

    @classmethod
    def of(cls, request: EngineRequest) -> Completion:
        wants_logprobs = request.sampling_params.logprobs is not None
        return cls(request.request_id, request.prompt, request.prompt_token_ids, [] if wants_logprobs else None)

    def add(self, delta: CompletionDelta) -> None:
        self.token_ids += delta.delta_token_ids
        if delta.delta_text:
            self._pieces.append(delta.delta_text)
        if delta.delta_logprobs and self.logprobs is not None:
            self.logprobs += delta.delta_logprobs
            for entry in delta.delta_logprobs:  # one at a time: the same float as summing the whole list
                self.cumulative_logprob += entry.logprob
        self.finished, self.finish_reason, self.stop_reason = delta.finished, delta.finish_reason, delta.stop_reason
        self.metrics = delta.metrics
        if delta.prompt_logprobs is not None:
            self.prompt_logprobs = delta.prompt_logprobs
        if delta.pooled is not None:
            self.pooled = delta.pooled

    @property
    def text(self) -> str:
        if len(self._pieces) > 1:
            self._pieces[:] = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    @property
    def outputs(self) -> list[Completion]:
        """vLLM shape: result.outputs[0].text."""
        return [self]
