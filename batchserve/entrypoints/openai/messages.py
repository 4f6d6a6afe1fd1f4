"""POST /v1/messages and /v1/messages/count_tokens (Anthropic's Messages API) as a translation onto the chat
machinery: system and content blocks become a chat conversation (serving/messages_input.py), rendered and submitted
as /v1/chat/completions would; the turn it generates (text, tool calls, thinking: the chat route's parsers) comes
back as content blocks, whole or as Anthropic's stream events. Errors take Anthropic's shape
(`{"type": "error", "error": {"type", "message"}}`)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from batchserve.entrypoints.openai.errors import APIError, as_api_error
from batchserve.entrypoints.openai.front import OpenAIFrontEnd
from batchserve.entrypoints.openai.protocol import RequestBody
from batchserve.entrypoints.openai.request_context import request_id_of
from batchserve.entrypoints.openai.streaming import AbortOnCloseResponse, wait_for_disconnect
from batchserve.entrypoints.openai.turns import (
    Piece,
    Turn,
    TurnStream,
    arguments_object,
    conversation_prompt,
    output_format,
    turn_params,
    whole_pieces,
)
from batchserve.serving.messages_input import chat_messages, chat_tool_choice, chat_tools, output_constraint
from batchserve.serving.results import GenerationResult
from batchserve.serving.tools import ToolRequest, tool_request

# Anthropic's error types by HTTP status (others: api_error)
_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}  # fmt: skip


class CountTokensRequest(RequestBody):
    model: str
    messages: list[Any] = Field(min_length=1)
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    output_config: dict[str, Any] | None = None  # {"format": {"type": "json_schema", "schema"}}: structured output
    timeout: float | None = None  # seconds this request may take, waiting and running (else --request-timeout)
    metadata: dict[str, Any] | None = None  # {"user_id"}: for the caller's own monitoring, changes nothing computed


def add_messages_routes(app: FastAPI, front: OpenAIFrontEnd) -> None:
    @app.post("/v1/messages")
    async def create(request: Request) -> Response:
        return await _anthropic_errors(create_message(front, request))

    @app.post("/v1/messages/count_tokens")
    async def count(request: Request) -> Response:
        return await _anthropic_errors(count_tokens(front, request))


async def _anthropic_errors(answer: Awaitable[Response]) -> Response:
    try:
        return await answer
    except Exception as exc:  # noqa: BLE001 - every error answers in Anthropic's shape (500s are still logged)
        error = as_api_error(exc)
        if error.status >= 500:
            raise
        return JSONResponse(anthropic_error(error), status_code=error.status, headers=error.headers)


def anthropic_error(error: APIError) -> dict[str, Any]:
    body = {"type": _ERROR_TYPES.get(error.status, "api_error"), "message": error.message}
    return {"type": "error", "error": body | ({"param": error.param} if error.param else {})}


async def _prompt(front: OpenAIFrontEnd, req: CountTokensRequest) -> tuple[list[int], ToolRequest | None]:
    choice, parallel = chat_tool_choice(req.tool_choice)
    tools = tool_request(chat_tools(req.tools), choice, parallel)
    return await conversation_prompt(front, chat_messages(req.system, req.messages), tools), tools


async def count_tokens(front: OpenAIFrontEnd, request: Request) -> Response:
    req = await front.parse(request, CountTokensRequest)
    prompt, _ = await _prompt(front, req)
    return JSONResponse({"input_tokens": len(prompt)})


async def create_message(front: OpenAIFrontEnd, request: Request) -> Response:
    req = await front.parse(request, MessagesRequest)
    deadline = front.service.deadline(req.timeout)
    prompt, tools = await _prompt(front, req)
    params = turn_params(front, len(prompt), req.max_tokens, tools, output_constraint(req.output_config), temperature=req.temperature,
                         top_p=req.top_p, top_k=req.top_k, stop=req.stop_sequences)  # fmt: skip
    service, params = front.service, front.with_adapter(params, req.model)
    streams = await service.submit(request_id_of(request, "msg"), [prompt], params, deadline=deadline)
    layout = MessageLayout(front.model_name, req, len(prompt))
    fmt = output_format(front, tools)
    if req.stream:
        events = _events(front, layout, streams, TurnStream(fmt).feed)
        return AbortOnCloseResponse(_named_sse(events), lambda: service.abort_unfinished(streams))
    [result] = await service.final_results(streams, wait_for_disconnect(request))
    pieces, _ = whole_pieces(fmt, result)
    blocks = ContentBlocks()
    for piece in pieces:
        blocks.feed(piece)
    return JSONResponse(layout.message(blocks.content(), result))


async def _events(
    front: OpenAIFrontEnd, layout: MessageLayout, streams: list[Any],
    pieces_of: Callable[[GenerationResult], list[Piece]],
) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
    yield {"type": "message_start", "message": layout.message([], None)}
    blocks, final = ContentBlocks(), None
    async for result in front.service.results(streams):
        for piece in pieces_of(result):
            for event in blocks.feed(piece):
                yield event
        final = result if result.finished else final
    for event in blocks.close():
        yield event
    assert final is not None, "a request's results end with a finished one"
    stop_reason, stop_sequence = layout.stop(blocks.turn, final)
    yield {"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
           "usage": {"output_tokens": final.delta.num_output_tokens}}  # fmt: skip
    yield {"type": "message_stop"}


async def _named_sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Each event under its type's name, as Anthropic's clients read them; a failure mid-stream is an error event."""
    try:
        async for event in events:
            yield _sse(event)
    except Exception as exc:  # noqa: BLE001 - the status line is gone; report in the stream
        yield _sse(anthropic_error(as_api_error(exc)))


def _sse(event: dict[str, Any]) -> str:
    return f"event: {event['type']}\ndata: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")) + "\n\n"


class MessageLayout:
    def __init__(self, model: str, request: MessagesRequest, prompt_tokens: int) -> None:
        self.id = f"msg_{uuid.uuid4().hex}"
        self.model = model
        self.request = request
        self.prompt_tokens = prompt_tokens

    def message(self, content: list[dict[str, Any]], result: GenerationResult | None) -> dict[str, Any]:
        stop_reason, stop_sequence = self.stop(None, result) if result is not None else (None, None)
        if result is not None and any(block["type"] == "tool_use" for block in content):
            stop_reason = "tool_use" if stop_reason == "end_turn" else stop_reason
        output_tokens = result.delta.num_output_tokens if result is not None else 0
        usage = {"input_tokens": self.prompt_tokens, "output_tokens": output_tokens,
                 "cache_read_input_tokens": result.delta.metrics.num_cached_tokens if result is not None else 0,
                 "cache_creation_input_tokens": 0}  # fmt: skip
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}  # fmt: skip

    def stop(self, turn: Turn | None, result: GenerationResult) -> tuple[str, str | None]:
        """(stop_reason, the stop sequence that ended the turn)."""
        if result.finish_reason == "length":
            return "max_tokens", None
        if turn is not None and any(block["kind"] == "call" for block in turn.blocks):
            return "tool_use", None
        matched = result.stop_reason
        if isinstance(matched, str) and matched in (self.request.stop_sequences or []):
            return "stop_sequence", matched
        return "end_turn", None


class ContentBlocks:
    """Pieces of a turn -> content blocks (thinking, text, tool_use) and the stream events that build them."""

    def __init__(self) -> None:
        self.turn = Turn()
        self.blocks: list[dict[str, Any]] = []
        self._kind = ""  # the open block's piece kind

    def feed(self, piece: Piece) -> list[dict[str, Any]]:
        self.turn.add(piece)
        events = []
        if piece.kind != "arguments" and (piece.kind == "call" or piece.kind != self._kind):
            events += self.close()
            events.append(self._start(piece))
        index = len(self.blocks) - 1
        block = self.blocks[index]
        if piece.kind == "text":
            block["text"] += piece.text
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "text_delta", "text": piece.text}})  # fmt: skip
        elif piece.kind == "reasoning":
            block["thinking"] += piece.text
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "thinking_delta", "thinking": piece.text}})  # fmt: skip
        elif piece.kind == "arguments":
            block["arguments"] += piece.text
            events.append({"type": "content_block_delta", "index": index,
                           "delta": {"type": "input_json_delta", "partial_json": piece.text}})  # fmt: skip
        return events

    def _start(self, piece: Piece) -> dict[str, Any]:
        self._kind = piece.kind
        if piece.kind == "call":
            block: dict[str, Any] = {"type": "tool_use", "id": piece.call_id, "name": piece.name, "input": {}}
            self.blocks.append({**block, "arguments": ""})
        elif piece.kind == "text":
            block = {"type": "text", "text": ""}
            self.blocks.append(dict(block))
        else:
            block = {"type": "thinking", "thinking": "", "signature": ""}
            self.blocks.append(dict(block))
        return {"type": "content_block_start", "index": len(self.blocks) - 1, "content_block": block}

    def close(self) -> list[dict[str, Any]]:
        if not self._kind:
            return []
        self._kind = ""
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def content(self) -> list[dict[str, Any]]:
        """The blocks of a whole message (a tool_use's input as the JSON object its arguments hold)."""
        out = []
        for block in self.blocks:
            if block["type"] == "tool_use":
                arguments = block["arguments"]
                block = {k: v for k, v in block.items() if k != "arguments"} | {"input": arguments_object(arguments)}
            out.append(block)
        return out
