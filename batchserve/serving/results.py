"""Engine outputs as protocol-neutral results: what every front end formats in its own way."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from batchserve.core.outputs import Logprobs
from batchserve.engine.llm_engine import CompletionOutput


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @classmethod
    def of(cls, results: Iterable[GenerationResult]) -> Usage:
        results = list(results)
        return cls(
            sum(len(r.prompt_token_ids) for r in results),
            sum(len(r.token_ids) for r in results),
            sum(r.num_cached_tokens for r in results),
        )


@dataclass(frozen=True)
class GenerationResult:
    """One request's progress after a step: what it gained (delta_*) and what it has so far."""

    index: int  # the prompt's position in its front-end request (the choice index)
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    delta_text: str
    delta_token_ids: list[int]
    logprobs: list[Logprobs] | None  # every sampled token's, when asked for
    delta_logprobs: list[Logprobs]
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None  # the stop token id or stop string that ended it
    num_cached_tokens: int

    @classmethod
    def of(cls, out: CompletionOutput, index: int = 0) -> GenerationResult:
        logprobs = out.logprobs
        # the snapshot holds every sampled token's logprobs: this step's are its last len(delta) entries
        delta_logprobs = logprobs[len(logprobs) - len(out.delta_token_ids) :] if logprobs else []
        return cls(
            index=index,
            request_id=out.request_id,
            prompt=out.prompt,
            prompt_token_ids=out.prompt_token_ids,
            text=out.text,
            token_ids=out.token_ids,
            delta_text=out.delta_text,
            delta_token_ids=out.delta_token_ids,
            logprobs=logprobs,
            delta_logprobs=delta_logprobs,
            finished=out.finished,
            finish_reason=out.finish_reason,
            stop_reason=out.stop_reason,
            num_cached_tokens=out.metrics.num_cached_tokens,
        )
