"""POST /v1/responses (OpenAI's Responses API) as a translation onto the chat machinery: the input items become a
chat conversation (serving/responses_input.py), rendered and submitted as /v1/chat/completions would, and the turn
it generates (text, tool calls, reasoning: the chat route's parsers) is laid out as output items, whole or streamed
as typed events. `store` keeps the response and its conversation (response_store.py) for GET, DELETE and a later
request's `previous_response_id`."""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field

from batchserve.entrypoints.openai.errors import APIError, as_api_error
from batchserve.entrypoints.openai.front import OpenAIFrontEnd
from batchserve.entrypoints.openai.protocol import RequestBody
from batchserve.entrypoints.openai.request_context import request_id_of
from batchserve.entrypoints.openai.response_store import ResponseStore
from batchserve.entrypoints.openai.streaming import AbortOnCloseResponse, wait_for_disconnect
from batchserve.entrypoints.openai.turns import (
    Piece,
    Turn,
    TurnStream,
    conversation_prompt,
    output_format,
    turn_params,
    whole_pieces,
)
from batchserve.sampling_params import InvalidRequestError
from batchserve.serving.responses_input import chat_tool_choice, chat_tools, input_messages, text_format_constraint
from batchserve.serving.results import GenerationResult, Usage
from batchserve.serving.tools import tool_request


class ResponsesRequest(RequestBody):
    model: str | None = None
    input: str | list[Any]
    instructions: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": {"type": "text" | "json_object" | "json_schema", ...}}
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    store: bool = True  # OpenAI's default
    previous_response_id: str | None = None
    background: bool | None = None
    metadata: dict[str, str] | None = None  # echoed back and kept with a stored response
    user: str | None = None  # an end-user id for the caller's own monitoring: it changes nothing computed
    truncation: Literal["disabled"] | None = None  # "auto" (dropping old turns to fit) is not built
    include: list[str] | None = Field(None, max_length=0)  # no extra output data is built
    timeout: float | None = None  # seconds this request may take, waiting and running (else --request-timeout)


def add_responses_routes(app: FastAPI, front: OpenAIFrontEnd, store: ResponseStore | None = None) -> None:
    store = store if store is not None else ResponseStore()
    app.state.response_store = store

    @app.post("/v1/responses")
    async def create(request: Request) -> Response:
        return await create_response(front, store, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Response:
        return JSONResponse(_stored(store, response_id).response)

    @app.delete("/v1/responses/{response_id}")
    async def delete(response_id: str) -> Response:
        _stored(store, response_id)
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})


def _stored(store: ResponseStore, response_id: str, param: str = "response_id") -> Any:
    stored = store.get(response_id)
    if stored is None:
        raise APIError(404, f"no stored response {response_id!r} (never stored, deleted, or expired)",
                       type_="not_found_error", param=param, code="response_not_found")  # fmt: skip
    return stored


async def create_response(front: OpenAIFrontEnd, store: ResponseStore, request: Request) -> Response:
    req = await front.parse(request, ResponsesRequest)
    deadline = front.service.deadline(req.timeout)
    if req.background:
        raise APIError(400, "background responses are not supported by this server: leave background unset and "
                       "keep the connection open (or stream)", param="background", code="unsupported_value")  # fmt: skip
    history = (
        _stored(store, req.previous_response_id, "previous_response_id").conversation
        if req.previous_response_id
        else []
    )
    conversation = history + input_messages(req.input)
    messages = ([{"role": "system", "content": req.instructions}] if req.instructions else []) + conversation
    tools = tool_request(chat_tools(req.tools), chat_tool_choice(req.tool_choice), req.parallel_tool_calls)
    prompt = await conversation_prompt(front, messages, tools)
    try:
        params = turn_params(front, len(prompt), req.max_output_tokens, tools, text_format_constraint(req.text),
                             temperature=req.temperature, top_p=req.top_p)  # fmt: skip
    except InvalidRequestError as exc:
        if exc.param == "max_tokens":
            raise InvalidRequestError(
                str(exc).replace("max_tokens", "max_output_tokens"), "max_output_tokens"
            ) from None
        raise
    service, params = front.service, front.with_adapter(params, req.model)
    streams = await service.submit(request_id_of(request, "resp"), [prompt], params, deadline=deadline)
    layout = ResponseLayout(front, req)
    fmt = output_format(front, tools)
    if req.stream:
        events = _events(front, store, layout, conversation, streams, fmt)
        return AbortOnCloseResponse(typed_sse(events), lambda: service.abort_unfinished(streams))
    [result] = await service.final_results(streams, wait_for_disconnect(request))
    pieces, _ = whole_pieces(fmt, result)
    items = OutputItems()
    for piece in pieces:
        items.feed(piece)
    items.close()
    response = layout.response(items.items, result)
    if req.store:
        store.put(layout.id, response, conversation + [items.turn.chat_message()])
    return JSONResponse(response)


async def _events(
    front: OpenAIFrontEnd, store: ResponseStore, layout: ResponseLayout, conversation: list[dict[str, Any]],
    streams: list[Any], fmt: Any,
) -> AsyncIterator[dict[str, Any]]:  # fmt: skip
    sequence = 0

    def numbered(event: dict[str, Any]) -> dict[str, Any]:
        nonlocal sequence
        sequence += 1
        return {**event, "sequence_number": sequence - 1}

    yield numbered({"type": "response.created", "response": layout.response([], None)})
    yield numbered({"type": "response.in_progress", "response": layout.response([], None)})
    turn, items, final = TurnStream(fmt), OutputItems(), None
    async for result in front.service.results(streams):
        for piece in turn.feed(result):
            for event in items.feed(piece):
                yield numbered(event)
        final = result if result.finished else final
    for event in items.close():
        yield numbered(event)
    assert final is not None, "a request's results end with a finished one"
    response = layout.response(items.items, final)
    if layout.request.store:
        store.put(layout.id, response, conversation + [items.turn.chat_message()])
    kind = "response.completed" if response["status"] == "completed" else "response.incomplete"
    yield numbered({"type": kind, "response": response})


async def typed_sse(events: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """Each event under its type's name (`event: response.created`); a failure after the status line went out
    is an `error` event."""
    try:
        async for event in events:
            yield _sse(event["type"], event)
    except Exception as exc:  # noqa: BLE001 - the status line is gone; report in the stream
        error = as_api_error(exc)
        yield _sse("error", {"type": "error", "code": error.code, "message": error.message, "param": error.param})


def _sse(name: str, payload: dict[str, Any]) -> str:
    return f"event: {name}\ndata: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"


class ResponseLayout:
    """The Response object of one request: its id and the request's echoed settings, with output and usage."""

    def __init__(self, front: OpenAIFrontEnd, request: ResponsesRequest) -> None:
        self.id = f"resp_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.model = front.model_name
        self.request = request

    def response(self, output: list[dict[str, Any]], result: GenerationResult | None) -> dict[str, Any]:
        """In progress (no result yet), completed, or incomplete (cut short by max_output_tokens)."""
        req = self.request
        status, incomplete = "in_progress", None
        if result is not None:
            cut_short = result.finish_reason == "length"
            status = "incomplete" if cut_short else "completed"
            incomplete = {"reason": "max_output_tokens"} if cut_short else None
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None, "incomplete_details": incomplete, "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens, "model": self.model, "output": output,
            "parallel_tool_calls": req.parallel_tool_calls is not False,
            "previous_response_id": req.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": req.store, "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": (req.text or {}).get("format") or {"type": "text"}},
            "tool_choice": req.tool_choice if req.tool_choice is not None else "auto", "tools": req.tools or [],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled",
            "usage": _usage(result) if result is not None else None, "user": req.user,
            "metadata": req.metadata or {},
        }  # fmt: skip


def _usage(result: GenerationResult) -> dict[str, Any]:
    usage = Usage.of([result])
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.total_tokens,
    }


_PART_TYPE = {"text": "output_text", "reasoning": "reasoning_text"}
_DELTA_EVENT = {"text": "response.output_text", "reasoning": "response.reasoning_text"}


class OutputItems:
    """Pieces of a turn -> output items (message, reasoning, function_call), and the stream events that build them:
    `added` when an item opens, deltas, `done` when the next item opens or the turn ends. A whole response's items
    are the same ones, built from the same pieces."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self.turn = Turn()
        self._open: dict[str, Any] | None = None
        self._kind = ""  # the open item's piece kind: text, reasoning or call

    def feed(self, piece: Piece) -> list[dict[str, Any]]:
        """The events of one piece."""
        self.turn.add(piece)
        return list(self._feed(piece))

    def _feed(self, piece: Piece) -> Iterator[dict[str, Any]]:
        if piece.kind == "arguments":
            assert self._open is not None and self._kind == "call", "arguments follow their call"
            self._open["arguments"] += piece.text
            yield {"type": "response.function_call_arguments.delta", **self._where(), "delta": piece.text}
            return
        if piece.kind == "call" or piece.kind != self._kind:
            yield from self.close()
            yield from self._start(piece)
        if piece.kind in _PART_TYPE:
            assert self._open is not None
            self._open["content"][0]["text"] += piece.text
            yield {"type": f"{_DELTA_EVENT[piece.kind]}.delta", **self._where(), "content_index": 0,
                   "delta": piece.text, **({"logprobs": []} if piece.kind == "text" else {})}  # fmt: skip

    def _start(self, piece: Piece) -> Iterator[dict[str, Any]]:
        self._kind = piece.kind
        if piece.kind == "call":
            item = {"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": piece.call_id,
                    "name": piece.name, "arguments": "", "status": "in_progress"}  # fmt: skip
        elif piece.kind == "text":
            item = {"type": "message", "id": f"msg_{uuid.uuid4().hex}", "status": "in_progress",
                    "role": "assistant", "content": []}  # fmt: skip
        else:
            item = {"type": "reasoning", "id": f"rs_{uuid.uuid4().hex}", "summary": [], "content": [],
                    "status": "in_progress"}  # fmt: skip
        self._open = item
        self.items.append(item)
        yield {"type": "response.output_item.added", "output_index": len(self.items) - 1, "item": _copy(item)}
        if piece.kind in _PART_TYPE:
            part = {
                "type": _PART_TYPE[piece.kind],
                "text": "",
                **({"annotations": [], "logprobs": []} if piece.kind == "text" else {}),
            }
            item["content"].append(part)
            yield {"type": "response.content_part.added", **self._where(), "content_index": 0, "part": _copy(part)}

    def close(self) -> list[dict[str, Any]]:
        """The events that finish the open item, if any."""
        item, kind = self._open, self._kind
        if item is None:
            return []
        self._open, self._kind = None, ""
        where = {"item_id": item["id"], "output_index": len(self.items) - 1}
        item["status"] = "completed"
        events: list[dict[str, Any]] = []
        if kind == "call":
            events.append({"type": "response.function_call_arguments.done", **where, "name": item["name"],
                           "arguments": item["arguments"]})  # fmt: skip
        else:
            part = item["content"][0]
            events.append({"type": f"{_DELTA_EVENT[kind]}.done", **where, "content_index": 0, "text": part["text"],
                           **({"logprobs": []} if kind == "text" else {})})  # fmt: skip
            events.append({"type": "response.content_part.done", **where, "content_index": 0, "part": _copy(part)})
        events.append({"type": "response.output_item.done", "output_index": where["output_index"], "item": _copy(item)})
        return events

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.items) - 1}


def _copy(value: dict[str, Any]) -> dict[str, Any]:
    """A snapshot for an event: the item goes on changing after it is sent."""
    return json.loads(json.dumps(value))
