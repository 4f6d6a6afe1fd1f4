"""A request whose Content-Length is over the body limit is answered 413 by the HTTP protocol itself, as soon as its
headers are in: no ASGI app runs, no byte of its body is parsed or kept.

The body the client sends anyway is then drained, unread, at a bounded rate (`DRAIN_BYTES_PER_S`), and the
connection closed once it has all arrived (or after `LINGER_S`). Closing at once would be cheaper still, but a
close with unread bytes is a TCP reset, and an asyncio client (httpx's AsyncClient, the OpenAI SDK's) that is still
writing the body then loses the 413 it has not read yet and reports a dropped connection instead. The bounded rate
holds back what goes past the kernel's socket buffers: on loopback those take a few megabytes at once, so a 4 MB
body is written in full and the client loops at its own speed; each refusal then costs the server an accept, a
header parse and a write, and the kernel a copy, where it cost a parse before. A repeat offender's 413 waits as
its other refusals do (error_delay.py); the connection is not closed before it has gone out.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from batchserve.entrypoints.openai.error_delay import OffenderTable
from batchserve.entrypoints.openai.errors import APIError
from batchserve.entrypoints.openai.messages import anthropic_error

DRAIN_BYTES_PER_S = 4 * 1024 * 1024  # past the socket buffers, a refused body arrives no faster than this
LINGER_S = 10.0  # a refused connection is closed this long after its 413 at the latest


class RefuseOversizedBodies:
    """Mixed into uvicorn's httptools protocol class (it keeps the request's headers in `self.headers` and its
    path in `self.url` until `on_headers_complete`)."""

    max_body_bytes: int
    offenders: OffenderTable | None
    headers: list[tuple[bytes, bytes]]
    url: bytes
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._drain_left: int | None = None  # bytes of a refused body still to drain; None: not refusing
        self._refusal: bytes | None = None  # a 413 held back for a repeat offender, until it has gone out
        self._close_when_sent = False

    def on_headers_complete(self) -> None:
        length = _content_length(self.headers)
        if length is None or length <= self.max_body_bytes:
            super().on_headers_complete()  # type: ignore[misc]
            return
        delay = self._offender_delay()
        self._drain_left = length
        if delay > 0:
            self._refusal = refusal(self.url, self.max_body_bytes)
            self.loop.call_later(delay, self._send_refusal)
        else:
            self.transport.write(refusal(self.url, self.max_body_bytes))
        self.loop.call_later(LINGER_S + delay, self._close)

    def _offender_delay(self) -> float:
        if self.offenders is None:
            return 0.0
        peer = self.transport.get_extra_info("peername")
        return self.offenders.refused(peer[0] if peer else None)

    def _send_refusal(self) -> None:
        answer, self._refusal = self._refusal, None
        if answer is not None and not self.transport.is_closing():
            self.transport.write(answer)
            if self._close_when_sent:
                self._close()

    def on_body(self, body: bytes) -> None:
        if self._drain_left is None:
            super().on_body(body)  # type: ignore[misc]
        else:
            self._drained(len(body))  # the part of the body that came with the headers

    def on_message_complete(self) -> None:
        if self._drain_left is None:
            super().on_message_complete()  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self._drain_left is None:
            super().data_received(data)  # type: ignore[misc]
        else:
            self._drained(len(data))

    def _drained(self, size: int) -> None:
        assert self._drain_left is not None
        self._drain_left -= size
        if self._drain_left <= 0:
            self._close()
        elif not self.transport.is_closing():
            self.transport.pause_reading()
            self.loop.call_later(size / DRAIN_BYTES_PER_S, self._resume)

    def _resume(self) -> None:
        if not self.transport.is_closing():
            self.transport.resume_reading()

    def _close(self) -> None:
        if self._refusal is not None:  # the body is in before its delayed 413 went out: close once it has
            self._close_when_sent = True
            return
        if not self.transport.is_closing():
            self.transport.close()


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    for name, value in headers:
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # the app answers a malformed length
    return None


def refusal(url: bytes, max_body_bytes: int) -> bytes:
    """The 413 response, in the error shape of the API the path belongs to (Anthropic's under /v1/messages)."""
    error = APIError(413, f"request body is over {max_body_bytes} bytes", code="body_too_large")
    payload: dict[str, Any] = anthropic_error(error) if url.startswith(b"/v1/messages") else error.body()
    body = json.dumps(payload, separators=(",", ":")).encode()
    head = (
        "HTTP/1.1 413 Request Entity Too Large\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body
