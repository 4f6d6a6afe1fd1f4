"""POST /v1/chat/completions: a conversation through the model's chat template, streamed over SSE or not."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from batchserve.core.outputs import Logprobs
from batchserve.engine.async_engine import RequestStream
from batchserve.entrypoints.openai.chat_output import ChatOutputFormat, ChoiceStream
from batchserve.entrypoints.openai.errors import APIError
from batchserve.entrypoints.openai.front import OpenAIFrontEnd, chunk_usage, finish_fields, sampling_params
from batchserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage, UsageInfo
from batchserve.entrypoints.openai.request_context import request_id_of
from batchserve.entrypoints.openai.streaming import AbortOnCloseResponse, sse_events, wait_for_disconnect
from batchserve.sampling_params import SamplingParams
from batchserve.serving.fanout import choices_usage, submit_choices
from batchserve.serving.generation import GenerationService
from batchserve.serving.reasoning import reasoning_parser
from batchserve.serving.results import GenerationResult
from batchserve.serving.tool_parsers import parser_for
from batchserve.serving.tools import ToolRequest, render_chat, tool_request


async def chat_prompt(
    service: GenerationService, messages: list[ChatMessage], add_generation_prompt: bool
) -> list[int]:
    conversation = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in messages]
    return await service.chat_prompt(conversation, add_generation_prompt)


async def create_chat_completion(front: OpenAIFrontEnd, request: Request) -> Response:
    req = await front.parse(request, ChatCompletionRequest)
    deadline = front.service.deadline(req.timeout)  # from arrival: rendering the template counts
    tools = tool_request(req.tools, req.tool_choice, req.parallel_tool_calls)
    if req.top_logprobs is not None and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    service = front.service
    prompt_ids = await _prompt_ids(front, req, tools)
    max_tokens = next(
        (n for n in (req.max_completion_tokens, req.max_tokens) if n is not None),
        service.limits.default_max_tokens(len(prompt_ids)),
    )  # 0 is refused by SamplingParams, never read as "no limit"
    params = with_tool_constraint(
        sampling_params(req, max_tokens, (req.top_logprobs or 0) if req.logprobs else None), tools
    )
    params = front.with_adapter(params, req.model)
    output_format = _output_format(front, tools)
    request_id = request_id_of(request, "chatcmpl")  # X-Request-Id when the client sent one
    streams = await submit_choices(service, request_id, [prompt_ids], params, req.priority, deadline)
    head = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
            "model": params.lora_name or front.model_name}  # fmt: skip
    if req.stream:
        chunks = _stream(front, req, {**head, "object": "chat.completion.chunk"}, streams, output_format)
        return AbortOnCloseResponse(sse_events(chunks), lambda: service.abort_unfinished(streams))
    results = await service.final_results(streams, wait_for_disconnect(request))
    choices = []
    for result in results:
        message, finish_reason = output_format.message(result.completion.text, result.finish_reason)
        logprobs = _logprobs(front, result.completion.logprobs or []) if req.logprobs else None
        choices.append({"index": result.index, "message": message, "logprobs": logprobs,
                        **finish_fields(result), "finish_reason": finish_reason})  # fmt: skip
    return JSONResponse({**head, "choices": choices, "usage": UsageInfo.of(choices_usage(results, req.n))})


async def _stream(
    front: OpenAIFrontEnd, req: ChatCompletionRequest, head: dict[str, Any], streams: list[RequestStream],
    output_format: ChatOutputFormat,
) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
    finals: list[GenerationResult] = []
    choice_streams: dict[int, ChoiceStream] = {}  # per choice; its first chunk carries the role
    async for result in front.service.results(streams):
        if not result.delta.delta_text and not result.finished:
            continue
        if result.finished:
            finals.append(result)
        # The role rides on the first token's chunk, not on a chunk of its own sent at arrival: clients time the
        # first chunk as the time to first token, so nothing may go out before the first token does.
        first = result.index not in choice_streams
        parsed = choice_streams.setdefault(result.index, output_format.stream())
        deltas = parsed.delta(result.delta.delta_text, result.finished) or [{}]
        if first:
            deltas[0] = (
                {"role": "assistant", "content": "", **deltas[0]}
                if "content" not in deltas[0]
                else {"role": "assistant", **deltas[0]}
            )
        logprobs = _logprobs(front, result.delta_logprobs) if req.logprobs else None
        for i, delta in enumerate(deltas):
            last = i == len(deltas) - 1
            if not delta and not last:
                continue
            finish = finish_fields(result) if last else {"finish_reason": None}
            if last and result.finished and parsed.called and finish["finish_reason"] == "stop":
                finish = {**finish, "finish_reason": "tool_calls"}
            choice = {"index": result.index, "delta": delta, "logprobs": logprobs if i == 0 else None, **finish}
            yield {**head, "choices": [choice], **(chunk_usage(req, result) if last else {})}
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


async def _prompt_ids(front: OpenAIFrontEnd, req: ChatCompletionRequest, tools: ToolRequest | None) -> list[int]:
    """The plain path (serving/chat.py) unless the conversation needs tools, tool turns, another template or
    template variables (serving/tools.py)."""
    service = front.service
    service.client.check_capacity()  # a full queue is refused before the conversation is rendered and tokenized
    tool_turns = any(m.tool_calls or m.role == "tool" for m in req.messages)
    if tools is None and not tool_turns and front.chat_template is None and not req.chat_template_kwargs:
        return await chat_prompt(service, req.messages, req.add_generation_prompt)
    service.check_text_length(sum(len(m.text()) for m in req.messages))
    messages = [
        {"role": "system" if m.role == "developer" else m.role, "content": m.text() if m.content is not None else None,
         **({"name": m.name} if m.name else {}), **({"tool_calls": m.tool_calls} if m.tool_calls else {}),
         **({"tool_call_id": m.tool_call_id} if m.tool_call_id else {})}
        for m in req.messages
    ]  # fmt: skip
    return await asyncio.to_thread(render_chat, service.tokenizer, messages, tools, front.chat_template,
                                   req.chat_template_kwargs, req.add_generation_prompt)  # fmt: skip


def with_tool_constraint(params: SamplingParams, tools: ToolRequest | None) -> SamplingParams:
    """tool_choice required or named: its grammar, which no other constraint may join."""
    constraint = tools.constraint() if tools is not None else None
    if constraint is None:
        return params
    if params.structured_outputs is not None:
        raise APIError(400, "tool_choice required or a named function cannot join another output constraint",
                       param="tool_choice")  # fmt: skip
    return dataclasses.replace(params, structured_outputs=constraint)


def _output_format(front: OpenAIFrontEnd, tools: ToolRequest | None) -> ChatOutputFormat:
    template = front.chat_template or front.service.tokenizer.chat_template
    parser = parser_for(front.tool_call_parser, template) if tools is not None else None
    return ChatOutputFormat(tools, parser, reasoning_parser(front.reasoning_parser))
