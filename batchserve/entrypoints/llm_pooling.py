"""LLM.embed and LLM.score (vLLM's offline pooling calls) over the engine's continuous batching: every input one
prefill-only request, pooled by the worker (docs/embeddings.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from batchserve.config import Convert
from batchserve.engine.inputs import Prompt, check_text
from batchserve.pooling_params import PoolingTask
from batchserve.sampling_params import InvalidRequestError
from batchserve.serving.pooling import (
    check_pooling_server,
    cosine,
    fit_input,
    pooling_sampling_params,
    relevance,
    score_pairs,
)

if TYPE_CHECKING:
    from batchserve.entrypoints.llm import LLM


@dataclass
class EmbeddingOutput:
    prompt_token_ids: list[int]
    embedding: list[float]


@dataclass
class ScoreOutput:
    prompt_token_ids: list[int]  # the pair's tokens (a classifier), or the first text's (an embedding model)
    score: float


def embed(
    llm: LLM, prompts: Prompt | Sequence[Prompt], dimensions: int | None = None, normalize: bool | None = None,
    truncate_prompt_tokens: int | None = None, use_tqdm: bool = False,
) -> list[EmbeddingOutput]:  # fmt: skip
    check_pooling_server(llm.engine.config, PoolingTask.EMBED, "LLM.embed")
    from batchserve.entrypoints.llm import _as_prompt_list

    token_lists = _token_lists(llm, _as_prompt_list(prompts), truncate_prompt_tokens)
    results = _run(llm, token_lists, pooling_sampling_params(PoolingTask.EMBED, dimensions, normalize), use_tqdm)
    return [EmbeddingOutput(ids, vector.tolist()) for ids, vector in zip(token_lists, results)]


def score(
    llm: LLM, text_1: str | Sequence[str], text_2: str | Sequence[str], truncate_prompt_tokens: int | None = None,
    use_tqdm: bool = False,
) -> list[ScoreOutput]:  # fmt: skip
    """vLLM's pairing: one text_1 against each text_2, or text_1[i] against text_2[i]."""
    check_pooling_server(llm.engine.config, None, "LLM.score")
    pairs = score_pairs(text_1, text_2)
    if llm.engine.config.convert == Convert.CLASSIFY:
        tokenizer, limits = llm.tokenizer, llm.engine.limits
        token_lists = [
            fit_input(limits, tokenizer(q, d)["input_ids"], truncate_prompt_tokens, "text_2") for q, d in pairs
        ]
        scores = _run(llm, token_lists, pooling_sampling_params(PoolingTask.CLASSIFY), use_tqdm)
        return [ScoreOutput(ids, relevance(s)) for ids, s in zip(token_lists, scores)]
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    token_lists = _token_lists(llm, texts, truncate_prompt_tokens)
    vectors = dict(zip(texts, _run(llm, token_lists, pooling_sampling_params(PoolingTask.EMBED), use_tqdm)))
    ids_of = dict(zip(texts, token_lists))
    return [ScoreOutput(ids_of[q], cosine(vectors[q], vectors[d])) for q, d in pairs]


def _token_lists(llm: LLM, prompts: list[Prompt], truncate_prompt_tokens: int | None) -> list[list[int]]:
    """Every prompt's tokens, the texts in one batched tokenizer call (one at a time costs milliseconds each)."""
    texts = [p for p in prompts if isinstance(p, str) and p]
    encoded = iter(llm.tokenizer([check_text(t, "input") for t in texts])["input_ids"] if texts else [])
    limits = llm.engine.limits
    token_lists = []
    for prompt in prompts:
        token_ids = next(encoded) if isinstance(prompt, str) and prompt else llm.engine.requests.tokenized(prompt)[1]
        token_ids = limits.check_token_ids(token_ids, "input token ids", "input")
        token_lists.append(fit_input(limits, token_ids, truncate_prompt_tokens, "input"))
    return token_lists


def _run(llm: LLM, token_lists: list[list[int]], params, use_tqdm: bool) -> list[torch.Tensor]:
    engine = llm.engine
    requests = [engine.requests.build(engine.new_request_id(), ids, params, param="input") for ids in token_lists]
    completions = llm.run_requests(requests, use_tqdm)
    missing = [c.request_id for c in completions if c.pooled is None]
    if missing:
        raise InvalidRequestError(f"requests {missing} ended before they were pooled", "input")
    return [c.pooled for c in completions]  # type: ignore[misc]
