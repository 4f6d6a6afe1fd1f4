"""POST /v1/chat/completions: a conversation through the model's chat template, streamed over SSE or not."""

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
from batchserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, UsageInfo
from batchserve.entrypoints.openai.request_context import request_id_of
from batchserve.entrypoints.openai.streaming import AbortOnCloseResponse, sse_events, wait_for_disconnect
from batchserve.serving.fanout import choices_usage, submit_choices
from batchserve.serving.generation import GenerationService
from batchserve.serving.results import GenerationResult


async def chat_prompt(
    service: GenerationService, messages: list[ChatMessage], add_generation_prompt: bool
) -> list[int]:
    conversation = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]
    return await service.chat_prompt(conversation, add_generation_prompt)


async def create_chat_completion(front: OpenAIFrontEnd, request: Request) -> Response:
    req = await front.parse(request, ChatCompletionRequest)
    if req.tools:
        raise APIError(400, "tools are not supported", param="tools")
    if req.tool_choice not in (None, "none", "auto"):  # "auto" without tools is "none"
        raise APIError(400, "tool_choice needs tools, which are not supported", param="tool_choice")
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    service = front.service
    prompt_ids = await chat_prompt(service, req.messages, req.add_generation_prompt)
    max_tokens = next(
        (n for n in (req.max_completion_tokens, req.max_tokens) if n is not None),
        service.limits.default_max_tokens(len(prompt_ids)),
    )  # 0 is refused by SamplingParams, never read as "no limit"
    params = sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None)
    request_id = request_id_of(request, "chatcmpl")  # X-Request-Id when the client sent one
    streams = await submit_choices(service, request_id, [prompt_ids], params, req.priority)
    head = {"id": request_id, "object": "chat.completion", "created": int(time.time()), "model": front.model_name}
    if req.stream:
        chunks = _stream(front, req, {**head, "object": "chat.completion.chunk"}, streams)
        return AbortOnCloseResponse(sse_events(chunks), lambda: service.abort_unfinished(streams))
    results = await service.final_results(streams, wait_for_disconnect(request))
    choices = [
        {
            "index": result.index,
            "message": {"role": "assistant", "content": result.completion.text},
            "logprobs": _logprobs(front, result.completion.logprobs or []) if req.logprobs else None,
            **finish_fields(result),
        }
        for result in results
    ]
    return JSONResponse({**head, "choices": choices, "usage": UsageInfo.of(choices_usage(results, req.n))})


async def _stream(
    front: OpenAIFrontEnd, req: ChatCompletionRequest, head: dict[str, Any], streams: list[RequestStream]
) -> AsyncIterator[dict[str, Any]]:
    finals: list[GenerationResult] = []
    role_sent: set[int] = set()  # the choices whose first chunk went out
    async for result in front.service.results(streams):
        if not result.delta.delta_text and not result.finished:
            continue
        if result.finished:
            finals.append(result)
        # The role rides on the first token's chunk, not on a chunk of its own sent at arrival: clients time the
        # first chunk as the time to first token, so nothing may go out before the first token does.
        first = result.index not in role_sent
        delta = {"content": result.delta.delta_text} if result.delta.delta_text or first else {}
        if first:
            delta = {"role": "assistant", **delta}
            role_sent.add(result.index)
        choice = {
            "index": result.index,
            "delta": delta,
            "logprobs": _logprobs(front, result.delta_logprobs) if req.logprobs else None,
            **finish_fields(result),
        }
        yield {**head, "choices": [choice], **chunk_usage(req, result)}
    if req.include_usage:
        yield {**head, "choices": [], "usage": UsageInfo.of(choices_usage(finals, req.n))}


def _logprobs(front: OpenAIFrontEnd, entries: list[Logprobs]) -> dict[str, Any]:
    token_text = front.service.token_text

    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top.items()]} for e in entries
        ]
    }
