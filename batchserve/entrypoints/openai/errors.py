"""OpenAI-shaped errors (``{"error": {"message", "type", "param", "code"}}``) and the API-key check."""

from __future__ import annotations

import math
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.types import ASGIApp, Receive, Scope, Send

from batchserve.entrypoints.api_key import api_key_matches
from batchserve.serving.errors import ErrorKind, classify

OPEN_PATHS = ("/health", "/metrics", "/dashboard")  # the dashboard page holds no data: /dashboard/data does
RETRY_AFTER_S = 1

# status, OpenAI error type, code
_BY_KIND: dict[ErrorKind, tuple[int, str, str | None]] = {
    ErrorKind.INVALID_REQUEST: (400, "invalid_request_error", None),
    ErrorKind.NOT_FOUND: (404, "not_found_error", None),
    ErrorKind.OVERLOADED: (503, "service_unavailable", "queue_full"),
    ErrorKind.UNAVAILABLE: (503, "service_unavailable", "engine_dead"),
    ErrorKind.CANCELLED: (499, "invalid_request_error", "client_closed_request"),
    ErrorKind.TIMEOUT: (408, "timeout_error", "request_timeout"),
    ErrorKind.INTERNAL: (500, "internal_error", None),
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def as_api_error(exc: BaseException) -> APIError:
    """Any exception as the OpenAI error a client gets (engine errors through the serving layer's kinds)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ValidationError | RequestValidationError):
        return validation_error(exc)
    error = classify(exc)
    status, type_, code = _BY_KIND[error.kind]
    retry_s = RETRY_AFTER_S if error.retry_after_s is None else max(RETRY_AFTER_S, math.ceil(error.retry_after_s))
    headers = {"Retry-After": str(retry_s)} if error.kind == ErrorKind.OVERLOADED else None
    return APIError(status, error.message, type_, error.param, code, headers)


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    if first.get("type") == "extra_forbidden":
        message = "unknown field: this server does not act on it (a server started with --lenient ignores it)"
    return APIError(400, f"{param}: {message}" if param else message, param=param, code="invalid_value")


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` (or ``x-api-key: <key>``, as Anthropic's clients send it) on every path but
    /health and /metrics (and /metrics too with `protect_metrics`: its labels can name models and its counts show the
    traffic); compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str, protect_metrics: bool = False) -> None:
        self.app = app
        self.api_key = api_key.encode()
        self.open_paths = tuple(p for p in OPEN_PATHS if not (protect_metrics and p == "/metrics"))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = next((value for name, value in scope["headers"] if name == b"authorization"), b"")
        if not given:  # Anthropic's clients send the key as `x-api-key: <key>`
            api_key = next((value for name, value in scope["headers"] if name == b"x-api-key"), None)
            given = b"Bearer " + api_key if api_key is not None else b""
        if api_key_matches(given, self.api_key):
            await self.app(scope, receive, send)
            return
        error = APIError(
            401, "invalid or missing API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
        await error.response()(scope, receive, send)
