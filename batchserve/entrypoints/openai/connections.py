"""Read deadlines on HTTP connections, which uvicorn does not have: its keep-alive timeout runs only after a
response, so a client that sends half a request line (or half a body) and waits holds a socket forever.

A request's headers must arrive within `header_timeout` of its first byte (of the connection, for the first
request), and while its body is read no gap between two reads may exceed `body_timeout` (nginx's
client_header_timeout and client_body_timeout). Past either the connection is closed. The whole body must arrive
within `body_read_timeout` of the headers' end: a client that trickles a byte a second never leaves a gap, so this
deadline is what cuts it, answered 408 (unless a response has begun) before the connection is closed. Once a request
is read, the time the app takes is not a read and is never timed out here.
"""

from __future__ import annotations

import asyncio
import json
import logging
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from batchserve.entrypoints.openai.body_limit import RefuseOversizedBodies
from batchserve.entrypoints.openai.error_delay import OffenderTable

logger = logging.getLogger("batchserve.server")

DEFAULT_HEADER_TIMEOUT_S = 30.0
DEFAULT_BODY_TIMEOUT_S = 60.0
DEFAULT_BODY_READ_TIMEOUT_S = 120.0  # a body's whole read: ample for the largest body at dial-up speed
DEFAULT_KEEP_ALIVE_TIMEOUT_S = 5.0  # uvicorn's: an idle keep-alive connection is closed after it


@dataclass(frozen=True)
class ConnectionLimits:
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_timeout_s: float = DEFAULT_KEEP_ALIVE_TIMEOUT_S
    max_connections: int | None = None  # over it, uvicorn answers 503 (its limit_concurrency)
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S
    max_body_bytes: int | None = None  # a larger Content-Length is answered 413 by the protocol (body_limit.py)

    def uvicorn_options(self, offenders: OffenderTable | None = None) -> dict[str, Any]:
        """uvicorn.Config keywords: the guarded protocol class, the keep-alive timeout and the connection cap.
        `offenders`: the app's table, so that a repeat offender's protocol-level 413 waits as its other 4xx do."""
        return {
            "http": guarded_protocol(
                self.header_timeout_s, self.body_timeout_s, self.body_read_timeout_s, self.max_body_bytes, offenders
            ),
            "timeout_keep_alive": self.keep_alive_timeout_s,
            "limit_concurrency": self.max_connections,
        }


class _ReadDeadlines:
    """Mixed into uvicorn's HTTP protocol class (httptools' or h11's: both keep the request in `self.cycle`, with
    `more_body` and `response_complete`)."""

    header_timeout_s: float
    body_timeout_s: float
    body_read_timeout_s: float
    cycle: Any
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._read_timer: asyncio.TimerHandle | None = None
        self._body_deadline: asyncio.TimerHandle | None = None
        self._body_cycle: Any = None  # the request whose body the deadline is for
        self._arm(self.header_timeout_s)

    def data_received(self, data: bytes) -> None:
        if self._read_timer is None and self._phase() == "headers":
            self._arm(self.header_timeout_s)  # the next request on a kept-alive connection: its clock starts
        super().data_received(data)  # type: ignore[misc]
        self._after_read()

    def on_response_complete(self) -> None:
        self._disarm()
        super().on_response_complete()  # type: ignore[misc]
        self._after_read()  # a pipelined request may have started from buffered bytes

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._end_body_deadline()
        super().connection_lost(exc)  # type: ignore[misc]

    def _phase(self) -> str:
        if getattr(self, "_drain_left", None) is not None:  # a refused body drains under its own deadline
            return "read"
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return "headers"
        return "body" if cycle.more_body else "read"

    def _after_read(self) -> None:
        phase = self._phase()
        if phase == "body":
            self._arm(self.body_timeout_s)  # the gap between reads, restarted at each one
            if self._body_cycle is not self.cycle:  # this request's body began: its whole read has a deadline
                self._end_body_deadline()
                self._body_cycle = self.cycle
                self._body_deadline = self.loop.call_later(self.body_read_timeout_s, self._body_expired)
        else:
            self._end_body_deadline()
            if phase == "read":
                self._disarm()

    def _end_body_deadline(self) -> None:
        deadline, self._body_deadline = getattr(self, "_body_deadline", None), None
        self._body_cycle = None
        if deadline is not None:
            deadline.cancel()

    def _body_expired(self) -> None:
        self._body_deadline = None
        if self._phase() != "body" or self.transport.is_closing():
            return
        logger.info("closing a connection whose request body took over %g s to arrive", self.body_read_timeout_s)
        if not self.cycle.response_started:
            self.transport.write(_REQUEST_TIMEOUT)
        self.transport.close()

    def _arm(self, timeout_s: float) -> None:
        self._disarm()
        self._read_timer = self.loop.call_later(timeout_s, self._expired)

    def _disarm(self) -> None:
        timer, self._read_timer = getattr(self, "_read_timer", None), None
        if timer is not None:
            timer.cancel()

    def _expired(self) -> None:
        self._read_timer = None
        phase = self._phase()
        if phase == "read" or self.transport.is_closing():
            return
        logger.info("closing a connection whose request %s did not arrive in time", phase)
        self.transport.close()


def _request_timeout_response() -> bytes:
    body = json.dumps({"error": {"message": "the request body did not arrive in time", "type": "invalid_request_error",
                                 "param": None, "code": "request_timeout"}}).encode()  # fmt: skip
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


_REQUEST_TIMEOUT = _request_timeout_response()


def guarded_protocol(
    header_timeout_s: float,
    body_timeout_s: float,
    body_read_timeout_s: float = DEFAULT_BODY_READ_TIMEOUT_S,
    max_body_bytes: int | None = None,
    offenders: OffenderTable | None = None,
) -> type[asyncio.Protocol]:
    """uvicorn's own HTTP protocol class (httptools when installed, else h11) with read deadlines and, with
    `max_body_bytes` and httptools, oversized bodies refused from their Content-Length (else the app refuses them)."""
    refuses = max_body_bytes is not None and issubclass(AutoHTTPProtocol, HttpToolsProtocol)
    return type(
        "GuardedHTTPProtocol",
        (_ReadDeadlines, *([RefuseOversizedBodies] if refuses else []), AutoHTTPProtocol),
        {
            "header_timeout_s": header_timeout_s,
            "body_timeout_s": body_timeout_s,
            "body_read_timeout_s": body_read_timeout_s,
            "max_body_bytes": max_body_bytes,
            "offenders": offenders if offenders is not None and offenders.config.enabled else None,
        },
    )
