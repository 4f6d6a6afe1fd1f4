"""Scoring on /v1/completions: `echo` with `logprobs` scores the prompt's tokens too (the first has no score),
`max_tokens: 0` with `echo` scores without generating (what evaluation harnesses send), and vLLM's
`prompt_logprobs` returns each prompt position's scores by token id. The scores come from the engine's batched
prefill (SamplingParams.prompt_logprobs); this module only asks for them and lays them out."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from batchserve.core.outputs import Logprobs
from batchserve.entrypoints.openai.errors import APIError
from batchserve.sampling_params import SamplingParams

# (token id, its logprob, the top alternatives): a prompt's first token has (id, None, None)
Entry = tuple[int, float | None, dict[int, float] | None]


@dataclasses.dataclass(frozen=True)
class Scoring:
    echo_logprobs: bool  # the prompt's tokens lead the choice's logprobs
    score_only: bool  # max_tokens 0: the one token generated (the engine always samples one) is dropped


def scoring_params(
    params: SamplingParams, echo: bool, logprobs: int | None, max_tokens: int, prompt_logprobs: int | None
) -> tuple[SamplingParams, Scoring]:
    if max_tokens == 0 and not echo:
        raise APIError(400, "max_tokens must be at least 1 (0 needs echo: scoring the prompt)", param="max_tokens")
    echo_logprobs = echo and logprobs is not None
    asked = [k for k in (prompt_logprobs, logprobs if echo_logprobs else None) if k is not None]
    if asked:
        params = dataclasses.replace(params, prompt_logprobs=max(asked))
    return params, Scoring(echo_logprobs, max_tokens == 0)


def prompt_entries(prompt_ids: list[int], scores: list[Logprobs | None] | None) -> list[Entry]:
    scores = scores or [None] * len(prompt_ids)
    return [(t, s.logprob, s.top) if s is not None else (t, None, None) for t, s in zip(prompt_ids, scores)]


def output_entries(entries: list[Logprobs]) -> list[Entry]:
    return [(e.token_id, e.logprob, e.top) for e in entries]


def vllm_prompt_logprobs(
    prompt_ids: list[int], scores: list[Logprobs | None] | None, token_text: Callable[[int], str]
) -> list[dict[str, Any] | None]:
    """vLLM's layout: per prompt position None (the first) or {token id: {logprob, rank, decoded_token}}, the
    prompt's own token and its top alternatives."""
    out: list[dict[str, Any] | None] = []
    for token_id, score in zip(prompt_ids, scores or []):
        if score is None:
            out.append(None)
            continue
        ranked = sorted(score.top.items(), key=lambda kv: -kv[1])
        position = {
            str(token_id): {"logprob": score.logprob, "rank": score.rank, "decoded_token": token_text(token_id)}
        }
        for rank, (tid, logprob) in enumerate(ranked, start=1):
            position.setdefault(str(tid), {"logprob": logprob, "rank": rank, "decoded_token": token_text(tid)})
        out.append(position)
    return out
