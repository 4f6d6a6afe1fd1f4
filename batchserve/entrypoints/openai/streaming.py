"""Server-sent events, and a streaming response that aborts its requests however it ends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from batchserve.entrypoints.openai.errors import as_api_error

SSE_DONE = "data: [DONE]\n\n"


def sse(payload: dict[str, Any]) -> str:
    return "data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"


async def sse_events(chunks: AsyncIterator[dict[str, Any]]) -> AsyncIterator[str]:
    """The chunks as events, then [DONE]; a failure after the status line went out is reported in the stream."""
    try:
        async for chunk in chunks:
            yield sse(chunk)
    except Exception as exc:  # noqa: BLE001 - the status line is gone; report in the stream
        yield sse(as_api_error(exc).body())
    yield SSE_DONE


class AbortOnCloseResponse(StreamingResponse):
    """A streaming response that aborts its requests however it ends (done, client gone, or never started)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


async def wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
