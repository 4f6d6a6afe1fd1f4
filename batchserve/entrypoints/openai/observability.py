"""What an operator watches, wired onto the app: the live dashboard (LiveStats and its routes), request ids echoed
in X-Request-Id, and optionally request traces (OpenTelemetry) and JSON access logs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import FastAPI

from batchserve.engine.async_engine import AsyncLLMEngine
from batchserve.entrypoints.openai.access_log import AccessLog
from batchserve.entrypoints.openai.dashboard import add_dashboard_routes
from batchserve.entrypoints.openai.request_context import RequestContextMiddleware
from batchserve.serving.live_stats import LiveStats

if TYPE_CHECKING:  # OpenTelemetry is an extra (batchserve[tracing])
    from batchserve.serving.tracing import RequestTracer


def add_observability(
    app: FastAPI, engine: AsyncLLMEngine, tracer: RequestTracer | None = None, access_log: AccessLog | None = None
) -> None:
    app.state.live_stats = LiveStats().attach(engine)
    add_dashboard_routes(app, app.state.live_stats)
    app.state.tracer = tracer.attach(engine) if tracer is not None else None
    app.state.access_log = access_log.attach(engine) if access_log is not None else None
    app.add_middleware(RequestContextMiddleware, access_log=access_log)  # outermost: it sees 401s and 413s too
