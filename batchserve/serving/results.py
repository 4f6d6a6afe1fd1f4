"""Engine outputs as protocol-neutral results: what every front end formats in its own way."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from batchserve.core.outputs import Logprobs
from batchserve.engine.outputs import Completion, CompletionDelta


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
        deltas = [r.delta for r in results]
        return cls(
            sum(d.num_prompt_tokens for d in deltas),
            sum(d.num_output_tokens for d in deltas),
            sum(d.metrics.num_cached_tokens for d in deltas),
        )


@dataclass(frozen=True)
class GenerationResult:
    """One request's progress after a step, placed in its front-end request: its choice index, what this step
    added (`delta`: token ids, text, logprobs, the counts so far, finish and stop reasons), and everything so far
    (`completion`, folded from the deltas: the same object for all of a request's results, read once it finished
    or for running totals)."""

    index: int  # the prompt's position in its front-end request (the choice index)
    delta: CompletionDelta
    completion: Completion

    @property
    def finished(self) -> bool:
        return self.delta.finished

    @property
    def delta_logprobs(self) -> list[Logprobs]:
        return self.delta.delta_logprobs or []

    @property
    def finish_reason(self) -> str | None:
        return self.delta.finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.delta.stop_reason
