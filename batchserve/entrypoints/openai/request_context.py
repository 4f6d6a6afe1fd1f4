"""Per-HTTP-request context: the request id (a client's `X-Request-Id`, used as the engine request's id and echoed
back; otherwise one made up), the caller's trace context handed to the tracer, and the JSON access log line written
when the response ends."""

from __future__ import annotations

import re
import time
from typing import Any

from fastapi import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from batchserve.entrypoints.openai.access_log import AccessLog
from batchserve.entrypoints.openai.protocol import random_id

REQUEST_ID_HEADER = "x-request-id"
_VALID_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")  # what fits in a header, a log line and a span attribute


def request_id_of(request: Request, prefix: str) -> str:
    """The id of the engine request(s) this HTTP request makes: the client's X-Request-Id when it is a sane token,
    else `prefix-<random>`; the tracer and the access log are told."""
    given = request.headers.get(REQUEST_ID_HEADER)
    request_id = given if given and _VALID_ID.fullmatch(given) else random_id(prefix)
    request.state.request_id = request_id
    tracer = getattr(request.app.state, "tracer", None)
    if tracer is not None:
        tracer.expect(request_id, request.headers)
    access_log = getattr(request.app.state, "access_log", None)
    if access_log is not None:
        access_log.expect(request_id)
    return request_id


class RequestContextMiddleware:
    """Echoes the request id in `X-Request-Id` (the one the route used, else the client's) and, with an AccessLog,
    writes a line per HTTP request once its response has ended."""

    def __init__(self, app: ASGIApp, access_log: AccessLog | None = None) -> None:
        self.app = app
        self.access_log = access_log

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.monotonic()
        state: dict[str, Any] = scope.setdefault("state", {})
        status = 500

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                request_id = state.get("request_id") or _header(scope, REQUEST_ID_HEADER.encode())
                if request_id:
                    headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"x-request-id"]
                    message["headers"] = [*headers, (b"x-request-id", request_id.encode("latin-1"))]
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        finally:
            if self.access_log is not None and scope["path"] not in AccessLog.QUIET_PATHS:
                self.access_log.http_done(state.get("request_id"), {
                    "method": scope["method"], "path": scope["path"], "status": status,
                    "duration_s": round(time.monotonic() - start, 6),
                    "client": (scope.get("client") or ("", 0))[0],
                })  # fmt: skip


def _header(scope: Scope, name: bytes) -> str | None:
    for key, value in scope.get("headers", []):
        if key == name:
            text = value.decode("latin-1")
            return text if _VALID_ID.fullmatch(text) else None
    return None
