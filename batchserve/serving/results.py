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
            sum(len(r.output.prompt_token_ids) for r in results),
            sum(len(r.output.token_ids) for r in results),
            sum(r.output.metrics.num_cached_tokens for r in results),
        )


@dataclass(frozen=True)
class GenerationResult:
    """One request's progress after a step, placed in its front-end request: the engine's output as it is (text and
    token ids so far, this step's deltas, finish and stop reasons), its choice index, and this step's logprobs."""

    index: int  # the prompt's position in its front-end request (the choice index)
    output: CompletionOutput
    delta_logprobs: list[Logprobs]

    @classmethod
    def of(cls, out: CompletionOutput, index: int = 0) -> GenerationResult:
        # the snapshot holds every sampled token's logprobs: this step's are its last len(delta) entries
        delta = out.logprobs[len(out.logprobs) - len(out.delta_token_ids) :] if out.logprobs else []
        return cls(index, out, delta)

    @property
    def finished(self) -> bool:
        return self.output.finished
