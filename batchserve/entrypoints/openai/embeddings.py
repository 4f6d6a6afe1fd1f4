"""Pooling routes (docs/embeddings.md): POST /v1/embeddings (OpenAI's shape), POST /v1/score and /score (vLLM's),
POST /v1/rerank, /rerank and /v2/rerank (Jina's and Cohere's), over serving/pooling.py. A server whose runner does
not compute what a route needs answers 400 saying which server to run."""

from __future__ import annotations

import time
from typing import Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from batchserve.config import Convert, EngineConfig, Runner
from batchserve.entrypoints.openai.errors import APIError
from batchserve.entrypoints.openai.front import OpenAIFrontEnd
from batchserve.entrypoints.openai.protocol import RequestBody, random_id
from batchserve.entrypoints.openai.request_context import request_id_of
from batchserve.entrypoints.openai.streaming import wait_for_disconnect
from batchserve.pooling_params import PoolingTask
from batchserve.serving.generation import Deadline
from batchserve.serving.pooling import (
    PoolingService,
    check_pooling_server,
    cosine,
    encode_embedding,
    pooling_sampling_params,
    relevance,
    score_pairs,
)


class EmbeddingRequest(RequestBody):
    """OpenAI's embeddings body, plus vLLM's truncate_prompt_tokens and normalize and the server's timeout."""

    model: str | None = None
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    truncate_prompt_tokens: int | None = None
    normalize: bool | None = None
    timeout: float | None = None


class ScoreRequest(RequestBody):
    """vLLM's score body: one text_1 against each text_2, or text_1[i] against text_2[i]."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    timeout: float | None = None


class RerankDocument(RequestBody):
    text: str


class RerankRequest(RequestBody):
    """Jina's and Cohere's rerank body: the documents ranked by relevance to the query, the best top_n."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    timeout: float | None = None


def served_task(config: EngineConfig) -> dict[str, str]:
    """What /v1/models says the model is run for: its runner, and a pooling runner's task."""
    if config.runner != Runner.POOLING:
        return {"runner": str(Runner.GENERATE)}
    return {"runner": str(Runner.POOLING), "convert": str(config.convert)}


BODIES = {"/v1/embeddings": EmbeddingRequest, "/v1/score": ScoreRequest, "/v1/rerank": RerankRequest}


def add_pooling_routes(app: FastAPI, front: OpenAIFrontEnd) -> None:
    pooling = PoolingService(front.service)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request) -> Response:
        return await create_embeddings(front, pooling, request)

    async def score(request: Request) -> Response:
        return await create_score(front, pooling, request)

    async def rerank(request: Request) -> Response:
        return await create_rerank(front, pooling, request)

    for path in ("/v1/score", "/score"):
        app.add_api_route(path, score, methods=["POST"], operation_id=f"score_{path.strip('/').replace('/', '_')}")
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        app.add_api_route(path, rerank, methods=["POST"], operation_id=f"rerank_{path.strip('/').replace('/', '_')}")


async def create_embeddings(front: OpenAIFrontEnd, pooling: PoolingService, request: Request) -> Response:
    req = await front.parse(request, EmbeddingRequest)
    deadline = front.service.deadline(req.timeout)
    check_pooling_server(front.service.client.config, PoolingTask.EMBED, "/v1/embeddings")
    items = _embedding_inputs(req.input)
    inputs = await pooling.token_id_lists(items, req.truncate_prompt_tokens, "input")
    params = pooling_sampling_params(PoolingTask.EMBED, req.dimensions, req.normalize)
    results = await pooling.run(request_id_of(request, "embd"), inputs, params, deadline, wait_for_disconnect(request))
    if req.dimensions is not None and req.dimensions > len(results[0].result):
        raise APIError(400, f"dimensions must be at most the model's {len(results[0].result)}", param="dimensions")
    data = [
        {"object": "embedding", "index": i, "embedding": encode_embedding(r.result, req.encoding_format)}
        for i, r in enumerate(results)
    ]
    tokens = sum(len(r.token_ids) for r in results)
    return JSONResponse({"object": "list", "data": data, "model": front.model_name,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})  # fmt: skip


def _embedding_inputs(value: str | list) -> list[str | list[int]]:
    """OpenAI's input forms: a text, texts, one token array, token arrays."""
    if isinstance(value, str):
        return [value]
    if not value:
        raise APIError(400, "input is empty", param="input")
    if all(isinstance(v, int) for v in value):
        return [value]
    return list(value)


async def create_score(front: OpenAIFrontEnd, pooling: PoolingService, request: Request) -> Response:
    req = await front.parse(request, ScoreRequest)
    deadline = front.service.deadline(req.timeout)
    check_pooling_server(front.service.client.config, None, "/v1/score")
    pairs = score_pairs(req.text_1, req.text_2)
    scores, tokens = await _scores(front, pooling, request, pairs, req.truncate_prompt_tokens, deadline, "text_2")
    data = [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)]
    return JSONResponse({"id": random_id("score"), "object": "list", "created": int(time.time()),
                         "model": front.model_name, "data": data,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})  # fmt: skip


async def create_rerank(front: OpenAIFrontEnd, pooling: PoolingService, request: Request) -> Response:
    req = await front.parse(request, RerankRequest)
    deadline = front.service.deadline(req.timeout)
    check_pooling_server(front.service.client.config, None, "/v1/rerank")
    if not req.query:
        raise APIError(400, "query is an empty string", param="query")
    if not req.documents:
        raise APIError(400, "documents is empty", param="documents")
    if req.top_n is not None and req.top_n < 1:
        raise APIError(400, f"top_n must be at least 1, got {req.top_n}", param="top_n")
    texts = [d if isinstance(d, str) else d.text for d in req.documents]
    pairs = [(req.query, text) for text in texts]
    scores, tokens = await _scores(front, pooling, request, pairs, req.truncate_prompt_tokens, deadline, "documents")
    order = sorted(range(len(texts)), key=lambda i: -scores[i])[: req.top_n]
    results = []
    for i in order:
        entry = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            entry["document"] = {"text": texts[i]}
        results.append(entry)
    return JSONResponse({"id": random_id("rerank"), "model": front.model_name, "results": results,
                         "usage": {"prompt_tokens": tokens, "total_tokens": tokens}})  # fmt: skip


async def _scores(
    front: OpenAIFrontEnd, pooling: PoolingService, request: Request, pairs: list[tuple[str, str]],
    truncate: int | None, deadline: Deadline | None, param: str,
) -> tuple[list[float], int]:  # fmt: skip
    """Each pair's score and the prompt tokens computed: a classifier's on the pair as one sequence, an embedding
    model's cosine of the two embeddings (each distinct text embedded once)."""
    request_id = request_id_of(request, "score")
    gone = wait_for_disconnect(request)
    if front.service.client.config.convert == Convert.CLASSIFY:
        inputs = [await pooling.pair_ids(q, d, truncate, param) for q, d in pairs]
        results = await pooling.run(request_id, inputs, pooling_sampling_params(PoolingTask.CLASSIFY), deadline, gone,
                                    param)  # fmt: skip
        return [relevance(r.result) for r in results], sum(len(r.token_ids) for r in results)
    texts = list(dict.fromkeys(t for pair in pairs for t in pair))
    inputs = await pooling.token_id_lists(texts, truncate, param)
    results = await pooling.run(request_id, inputs, pooling_sampling_params(PoolingTask.EMBED), deadline, gone, param)
    vectors = {t: r.result for t, r in zip(texts, results)}
    return [cosine(vectors[q], vectors[d]) for q, d in pairs], sum(len(r.token_ids) for r in results)
