"""What an operator watches, wired onto the app: the live dashboard (LiveStats and its routes), request ids echoed
in X-Request-Id, and optionally request traces (OpenTelemetry) and JSON access logs."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI

from batchserve.engine.async_engine import AsyncLLMEngine
from batchserve.entrypoints.openai.access_log import AccessLog, configure_json_logging
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


def add_observability_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("observability (the live page is at /dashboard)")
    group.add_argument(
        "--otlp-traces-endpoint", default=None,
        help="send a span per request (OTLP over HTTP, e.g. http://127.0.0.1:4318/v1/traces; needs "
        "batchserve[tracing]); a client's W3C traceparent becomes the parent",
    )  # fmt: skip
    group.add_argument(
        "--log-format", choices=["text", "json"], default="text",
        help="json: every log line a JSON object, and an access line per request with its id, status, tokens, TTFT "
        "and e2e (default: text)",
    )  # fmt: skip


def observability_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    """build_app's `tracer` and `access_log` for these flags; JSON logging is configured here."""
    options: dict[str, Any] = {"tracer": None, "access_log": None}
    if args.log_format == "json":
        configure_json_logging(args.log_level)
        options["access_log"] = AccessLog()
    if args.otlp_traces_endpoint:
        try:
            from batchserve.serving.tracing import RequestTracer, otlp_exporter, tracer_provider
        except ImportError as exc:
            parser.error(f"--otlp-traces-endpoint needs OpenTelemetry: pip install 'batchserve[tracing]' ({exc})")
        options["tracer"] = RequestTracer(tracer_provider(otlp_exporter(args.otlp_traces_endpoint)))
    return options
