"""`--log-format json`: every log record as one JSON object a line, and an access log line per HTTP request with
what the engine did for it (request id, status, prompt / cached / output tokens, TTFT, e2e).

The HTTP side (a response ended) and the engine side (the request's final output, on the loop thread) meet here:
the line is written by whichever comes second, so a response that ends before the step listener has run still gets
its tokens and latencies.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from batchserve.engine.async_engine import AsyncLLMEngine
from batchserve.engine.llm_engine import LLMEngine
from batchserve.engine.outputs import CompletionDelta

ACCESS_LOGGER = "batchserve.access"
PENDING_TIMEOUT_S = 10.0  # a finished response whose engine summary never came (aborted unseen) is logged without it


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, logger, message, and the record's `fields` (an access line's)."""

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S") + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        line.update(getattr(record, "fields", {}))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, default=str)


def configure_json_logging(level: str = "info") -> None:
    handler = logging.StreamHandler()
    formatter = JsonFormatter()
    formatter.converter = time.gmtime
    handler.setFormatter(formatter)
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):  # through the root's JSON handler
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True


class AccessLog:
    QUIET_PATHS = ("/metrics", "/health", "/dashboard/data")  # polled every few seconds: not worth a line each

    def __init__(self, logger: logging.Logger | None = None) -> None:
        self.logger = logger or logging.getLogger(ACCESS_LOGGER)
        self._lock = threading.Lock()
        self._expected: set[str] = set()
        self._summaries: dict[str, dict[str, Any]] = {}
        self._pending: dict[str, tuple[float, dict[str, Any]]] = {}  # request id -> (when, the HTTP side's fields)

    def attach(self, engine: AsyncLLMEngine) -> AccessLog:
        engine.step_listeners.append(self.on_step)
        return self

    def expect(self, request_id: str) -> None:
        with self._lock:
            self._expected.add(request_id)

    # ------------------------------------------------------------------ engine loop thread
    def on_step(self, engine: LLMEngine, outputs: Sequence[CompletionDelta]) -> None:
        for out in outputs:
            if out.finished:
                self._engine_done(out)

    def _engine_done(self, out: CompletionDelta) -> None:
        base = out.request_id if out.request_id in self._expected else out.request_id.rpartition("-")[0]
        if base not in self._expected:
            return
        with self._lock:
            summary = self._summaries.setdefault(base, _empty_summary())
            _add(summary, out)
            pending = self._pending.pop(base, None)
            if pending is not None:
                self._expected.discard(base)
                self._summaries.pop(base, None)
        if pending is not None:
            self._write(base, pending[1], summary)

    # ------------------------------------------------------------------ event loop
    def http_done(self, request_id: str | None, fields: dict[str, Any]) -> None:
        with self._lock:
            summary = self._summaries.pop(request_id, None) if request_id else None
            waiting_for_engine = summary is None and request_id in self._expected and fields["status"] < 400
            if waiting_for_engine:
                self._pending[request_id] = (time.monotonic(), fields)  # type: ignore[index]
            else:
                self._expected.discard(request_id)  # type: ignore[arg-type]
            stale = self._stale()
        if not waiting_for_engine:
            self._write(request_id, fields, summary)
        for stale_id, stale_fields in stale:
            self._write(stale_id, stale_fields, None)

    def _stale(self) -> list[tuple[str, dict[str, Any]]]:
        cutoff = time.monotonic() - PENDING_TIMEOUT_S
        stale = [(rid, f) for rid, (when, f) in self._pending.items() if when < cutoff]
        for rid, _ in stale:
            del self._pending[rid]
            self._expected.discard(rid)
            self._summaries.pop(rid, None)
        return stale

    def _write(self, request_id: str | None, fields: dict[str, Any], summary: dict[str, Any] | None) -> None:
        line = {"request_id": request_id, **fields, **(summary or {})}
        self.logger.info("%s %s %s", fields["method"], fields["path"], fields["status"], extra={"fields": line})


def _empty_summary() -> dict[str, Any]:
    return {"prompt_tokens": 0, "cached_tokens": 0, "output_tokens": 0, "ttft_s": None, "e2e_s": None,
            "finish_reason": None}  # fmt: skip


def _add(summary: dict[str, Any], out: CompletionDelta) -> None:
    """Fold one engine request into its HTTP request's summary (a batch of prompts: sums, the slowest latency)."""
    m = out.metrics
    summary["prompt_tokens"] += out.num_prompt_tokens
    summary["cached_tokens"] += m.num_cached_tokens
    summary["output_tokens"] += out.num_output_tokens
    summary["finish_reason"] = out.finish_reason or "abort"
    if m.first_token_time is not None:
        ttft = round(m.first_token_time - m.arrival_time, 6)
        summary["ttft_s"] = max(summary["ttft_s"] or 0.0, ttft)
    if m.finished_time is not None:
        e2e = round(m.finished_time - m.arrival_time, 6)
        summary["e2e_s"] = max(summary["e2e_s"] or 0.0, e2e)
