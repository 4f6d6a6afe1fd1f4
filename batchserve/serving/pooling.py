"""Pooling requests, whatever the front end (docs/embeddings.md): inputs (texts, token arrays, query/document pairs)
to engine requests within the model's context, and their results back (embeddings, scores, a rerank order).

A score on an embedding model is the cosine similarity of the two texts' embeddings; on a classifier (a
*ForSequenceClassification head, or a causal LM scored yes/no) it is the head's probability on the pair, tokenized
as one sequence (the tokenizer's text pair, as a cross-encoder reads it)."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from batchserve.config import Convert, EngineConfig, Runner
from batchserve.engine.inputs import EngineLimits, check_text
from batchserve.engine.outputs import Completion
from batchserve.pooling_params import PoolingParams, PoolingTask
from batchserve.sampling_params import InvalidRequestError, SamplingParams
from batchserve.serving.generation import Deadline, GenerationService

MAX_POOLING_INPUTS = 2048  # OpenAI's bound on an embeddings request's inputs
ENCODING_FORMATS = ("float", "base64")

if TYPE_CHECKING:  # results are tensors the engine made: unpickling the first one imports torch, not this module
    import torch


def pooling_sampling_params(task: PoolingTask, dimensions: int | None = None, normalize: bool | None = None):
    """What a pooling request carries to the worker: one step of prompt, no token sampled."""
    return SamplingParams(max_tokens=1, temperature=0.0, pooling=PoolingParams(task, dimensions, normalize))


def fit_input(limits: EngineLimits, token_ids: list[int], truncate_prompt_tokens: int | None, param: str) -> list[int]:
    """An input's tokens within the model's context: its last `truncate_prompt_tokens` (-1: as many as fit) when the
    caller asks, else as they are or a 400 naming the field."""
    if truncate_prompt_tokens is not None:
        if (
            isinstance(truncate_prompt_tokens, bool)
            or not isinstance(truncate_prompt_tokens, int)
            or not (truncate_prompt_tokens == -1 or 1 <= truncate_prompt_tokens <= limits.max_input_len)
        ):
            raise InvalidRequestError(
                f"truncate_prompt_tokens must be -1 or 1..{limits.max_input_len} (the model's input limit), got "
                f"{truncate_prompt_tokens!r}",
                "truncate_prompt_tokens",
            )
        keep = limits.max_input_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
        token_ids = token_ids[-keep:]
    if len(token_ids) > limits.max_input_len:
        raise InvalidRequestError(
            f"{param} has {len(token_ids)} tokens, more than the model's {limits.max_input_len} (max_model_len "
            f"{limits.max_model_len}); set truncate_prompt_tokens to keep its last tokens",
            param,
        )
    return token_ids


def check_pooling_server(config: EngineConfig, task: PoolingTask | None, endpoint: str) -> None:
    """A 400 before any tokenizing when this server does not run its model for `endpoint` (task None: either)."""
    model = config.model or "MODEL"
    if config.runner != Runner.POOLING:
        raise InvalidRequestError(
            f"{endpoint} needs a pooling server: this one runs its model for generation (--runner generate); run "
            f"batchserve serve {model} --runner pooling",
            "model",
        )
    if task is not None and config.convert != task:
        other = "/v1/score or /v1/rerank" if config.convert == Convert.CLASSIFY else "/v1/embeddings"
        raise InvalidRequestError(
            f"{endpoint} needs a model run with --convert {task}; this server's computes {config.convert} (use "
            f"{other})",
            "model",
        )


def encode_embedding(vector: torch.Tensor, encoding_format: str) -> list[float] | str:
    """OpenAI's encodings: a list of floats, or base64 of the little-endian float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(vector.numpy().astype("<f4").tobytes()).decode("ascii")
    return vector.tolist()


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second or not all(isinstance(t, str) and t for t in first + second):
        raise InvalidRequestError("text_1 and text_2 must be non-empty strings or lists of them", "text_1")
    if len(first) == 1:
        return [(first[0], d) for d in second]
    if len(first) != len(second):
        raise InvalidRequestError(f"{len(first)} text_1 for {len(second)} text_2: give one, or as many", "text_2")
    return list(zip(first, second))


def relevance(pooled: torch.Tensor) -> float:
    """A classifier's score of a pair: its one label's probability, or the last label's of several."""
    return float(pooled[-1])


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    import torch

    return float(torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=0))


@dataclass(frozen=True)
class PooledInput:
    """One input's tokens and, once run, its result."""

    token_ids: list[int]
    result: torch.Tensor


class PoolingService:
    """Runs pooling requests over a front end's GenerationService: its admission (all or none), deadlines, aborts."""

    def __init__(self, service: GenerationService) -> None:
        self.service = service

    @property
    def limits(self) -> EngineLimits:
        return self.service.limits

    async def token_id_lists(
        self, items: Sequence[str | list[int]], truncate: int | None, param: str
    ) -> list[list[int]]:
        """Texts tokenized in one batched call off the event loop (special tokens as the model's tokenizer adds
        them), token arrays checked; each within the context (fit_input)."""
        texts = [item for item in items if isinstance(item, str)]
        for text in texts:
            self._check_text(text, truncate, param)
        tokenizer = self.service.tokenizer
        encoded = iter(await asyncio.to_thread(lambda: tokenizer(texts)["input_ids"]) if texts else [])
        lists = []
        for item in items:
            ids = list(next(encoded)) if isinstance(item, str) else item
            ids = self.limits.check_token_ids(ids, f"{param} token ids", param)
            lists.append(fit_input(self.limits, ids, truncate, param))
        return lists

    def _check_text(self, text: str, truncate: int | None, param: str) -> None:
        if not text:
            raise InvalidRequestError(f"{param} holds an empty string", param)
        check_text(text, param)
        if truncate is None:  # a text that cannot fit is refused before tokenizing (a truncated one is not)
            try:
                self.service.check_text_length(len(text))
            except InvalidRequestError as exc:
                raise InvalidRequestError(f"{param}: {exc}; set truncate_prompt_tokens to keep its last tokens",
                                          param) from None  # fmt: skip

    async def pair_ids(self, query: str, document: str, truncate: int | None, param: str) -> list[int]:
        """A query/document pair as one sequence, as the tokenizer joins a text pair (a cross-encoder's input)."""
        check_text(query, "query"), check_text(document, param)
        tokenizer = self.service.tokenizer
        ids = await asyncio.to_thread(lambda: tokenizer(query, document)["input_ids"])
        return fit_input(self.limits, list(ids), truncate, param)

    async def run(
        self,
        base_id: str,
        inputs: Sequence[list[int]],
        params: SamplingParams,
        deadline: Deadline | None,
        caller_gone: Awaitable[Any] | None = None,
        param: str = "input",
    ) -> list[PooledInput]:
        """Every input as one engine request, all admitted or none; their results in input order."""
        if not inputs:
            raise InvalidRequestError(f"{param} is empty", param)
        if len(inputs) > MAX_POOLING_INPUTS:
            raise InvalidRequestError(f"at most {MAX_POOLING_INPUTS} inputs per request, got {len(inputs)}", param)
        build = self.service.requests.build
        requests = [build(f"{base_id}-{i}", ids, params, param=param) for i, ids in enumerate(inputs)]
        streams = await self.service.admit(requests, deadline)
        results = await self.service.final_results(streams, caller_gone)
        return [PooledInput(list(ids), _pooled(r.completion)) for ids, r in zip(inputs, results)]


def _pooled(completion: Completion) -> torch.Tensor:
    if completion.pooled is None:  # aborted by the engine (never schedulable): no result to give
        raise InvalidRequestError(
            f"the input of request {completion.request_id} was ended before it was pooled ({completion.finish_reason})",
            "input",
        )
    return completion.pooled  # type: ignore[return-value]
