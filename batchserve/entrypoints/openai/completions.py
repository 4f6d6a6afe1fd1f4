"""POST /v1/completions: one or more prompts (text or token ids), streamed over SSE or answered at once."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from batchserve.core.outputs import Logprobs
from batchserve.engine.async_engine import RequestStream
from batchserve.entrypoints.openai.errors import APIError
from batchserve.entrypoints.openai.front import OpenAIFrontEnd, chunk_usage, finish_fields, sampling_params
from batchserve.entrypoints.openai.protocol import CompletionRequest, UsageInfo
from batchserve.entrypoints.openai.request_context import request_id_of
from batchserve.entrypoints.openai.streaming import AbortOnCloseResponse, sse_events, wait_for_disconnect
from batchserve.serving.fanout import choices_usage, submit_choices
from batchserve.serving.results import GenerationResult

Prompt = str | list[int]


async def create_completion(front: OpenAIFrontEnd, request: Request) -> Response:
    req = await front.parse(request, CompletionRequest)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of not in (None, 1):
        raise APIError(400, "best_of must be 1", param="best_of")
    prompts = _prompts(req.prompt)
    params = sampling_params(req, req.max_tokens if req.max_tokens is not None else 16, req.logprobs)
    request_id = request_id_of(request, "cmpl")  # X-Request-Id when the client sent one
    streams = await submit_choices(front.service, request_id, prompts, params, req.priority)
    head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": front.model_name}
    if req.stream:
        chunks = _stream(front, req, head, prompts, streams)
        return AbortOnCloseResponse(sse_events(chunks), lambda: front.service.abort_unfinished(streams))
    results = await front.service.final_results(streams, wait_for_disconnect(request))
    choices = []
    for result in results:
        prefix = _echo(front, prompts[result.index // req.n], result) if req.echo else ""
        completion = result.completion
        logprobs = _logprobs(front, completion.logprobs or [], len(prefix)) if req.logprobs is not None else None
        text = prefix + completion.text
        choices.append({"index": result.index, "text": text, "logprobs": logprobs, **finish_fields(result)})
    return JSONResponse({**head, "choices": choices, "usage": UsageInfo.of(choices_usage(results, req.n))})


def _prompts(prompt: str | list[int] | list[str] | list[list[int]]) -> list[Prompt]:
    """One prompt or a batch of them; each is checked when the serving layer builds its engine request."""
    if isinstance(prompt, str) or (prompt and all(isinstance(p, int) for p in prompt)):
        return [prompt]  # type: ignore[list-item]
    if not prompt:
        raise APIError(400, "prompt must not be empty", param="prompt", code="empty_prompt")
    return list(prompt)  # type: ignore[arg-type]


def _echo(front: OpenAIFrontEnd, prompt: Prompt, result: GenerationResult) -> str:
    return prompt if isinstance(prompt, str) else front.service.tokenizer.decode(result.completion.prompt_token_ids)


async def _stream(
    front: OpenAIFrontEnd, req: CompletionRequest, head: dict[str, Any], prompts: list[Prompt],
    streams: list[RequestStream],
) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
    finals: list[GenerationResult] = []
    sent: dict[int, int] = {}  # characters sent per choice (the logprobs' text offsets)
    async for result in front.service.results(streams):
        delta = result.delta.delta_text
        if req.echo and result.index not in sent:
            delta = _echo(front, prompts[result.index // req.n], result) + delta
        if not delta and not result.finished:
            continue
        offset = sent.get(result.index, 0)
        sent[result.index] = offset + len(delta)
        logprobs = _logprobs(front, result.delta_logprobs, offset) if req.logprobs is not None else None
        if result.finished:
            finals.append(result)
        choice = {"index": result.index, "text": delta, "logprobs": logprobs, **finish_fields(result)}
        yield {**head, "choices": [choice], **chunk_usage(req, result)}
    if req.include_usage:
        yield {**head, "choices": [], "usage": UsageInfo.of(choices_usage(finals, req.n))}


def _logprobs(front: OpenAIFrontEnd, entries: list[Logprobs], offset: int) -> dict[str, Any]:
    token_text = front.service.token_text
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for entry in entries:
        text = token_text(entry.token_id)
        tokens.append(text)
        token_logprobs.append(entry.logprob)
        top_logprobs.append({token_text(t): lp for t, lp in entry.top.items()})
        text_offset.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }
