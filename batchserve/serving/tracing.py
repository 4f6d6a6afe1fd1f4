"""OpenTelemetry traces of requests (`--otlp-traces-endpoint`, as vLLM's flag): one span per engine request, from its
arrival to its finish, with an event when it was queued, for each prefill chunk the scheduler gave it, at its first
token, at each preemption and at its finish; attributes for its prompt, cached and output tokens and its priority.
A caller's W3C `traceparent` makes the span a child of the caller's.

Everything is read from the engine after each step (a step listener on the loop thread): the scheduler's stats name
the requests it scheduled, the outputs carry each request's timings. The engine itself knows nothing of tracing.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from batchserve.engine.async_engine import AsyncLLMEngine
from batchserve.engine.llm_engine import LLMEngine
from batchserve.engine.outputs import CompletionDelta

SPAN_NAME = "llm_request"
MAX_PARENTS = 10_000  # callers' contexts waiting for their request's first step; the oldest go beyond this
SWEEP_EVERY_STEPS = 256  # how often spans of requests the engine no longer holds (aborted unseen) are ended
_PROPAGATOR = TraceContextTextMapPropagator()


def otlp_exporter(endpoint: str) -> SpanExporter:
    """OTLP over HTTP/protobuf (`http://host:4318/v1/traces`; a bare `host:port` gets that path)."""
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    if "://" not in endpoint:
        endpoint = f"http://{endpoint}"
    if endpoint.rstrip("/").count("/") == 2:  # scheme://host:port only
        endpoint = endpoint.rstrip("/") + "/v1/traces"
    return OTLPSpanExporter(endpoint=endpoint)


def tracer_provider(exporter: SpanExporter, service_name: str = "batchserve") -> TracerProvider:
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


@dataclass
class _Open:
    span: Span
    preemptions: int = 0
    first_token_seen: bool = False


class RequestTracer:
    """Spans of one engine's requests. `expect` (any thread) hands over a caller's headers before its request is
    added; `on_step` (the engine loop) does the rest."""

    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("batchserve")
        self._parents: OrderedDict[str, Context] = OrderedDict()
        self._lock = threading.Lock()
        self._open: dict[str, _Open] = {}
        self._wall_offset_ns = time.time_ns() - time.monotonic_ns()

    def attach(self, engine: AsyncLLMEngine) -> RequestTracer:
        engine.step_listeners.append(self.on_step)
        return self

    def shutdown(self) -> None:
        self.provider.shutdown()

    # ------------------------------------------------------------------ any thread
    def expect(self, request_id: str, headers: Mapping[str, str]) -> None:
        """The caller's trace context (W3C traceparent / tracestate) for the request(s) `request_id` (and
        `request_id-i`, a batch of prompts)."""
        if "traceparent" not in headers:
            return
        context = _PROPAGATOR.extract(carrier={k: v for k, v in headers.items() if k in ("traceparent", "tracestate")})
        with self._lock:
            self._parents[request_id] = context
            while len(self._parents) > MAX_PARENTS:
                self._parents.popitem(last=False)

    def _parent(self, request_id: str) -> Context | None:
        with self._lock:
            context = self._parents.pop(request_id, None)
            if context is None:
                base = request_id.rpartition("-")[0]
                context = self._parents.get(base)  # kept for the batch's other prompts (dropped when the cap is hit)
            return context

    # ------------------------------------------------------------------ engine loop thread
    def on_step(self, engine: LLMEngine, outputs: Sequence[CompletionDelta]) -> None:
        stats = engine.last_stats
        step_start = self._ns(time.monotonic() - engine.last_step_time_s)
        if stats is not None:
            finished_now = {out.request_id: out for out in outputs if out.finished}
            for request_id, (tokens, prefill) in stats.scheduled.items():
                entry = self._open.get(request_id) or self._start(engine, request_id, finished_now.get(request_id))
                if entry is not None and prefill:
                    entry.span.add_event("prefill_chunk", {"tokens": tokens}, timestamp=step_start)
            if stats.num_preempted_this_step:
                self._mark_preemptions(engine, step_start)
        for out in outputs:
            self._on_output(engine, out)
        if engine.num_steps % SWEEP_EVERY_STEPS == 0:
            self._sweep(engine)

    def _start(self, engine: LLMEngine, request_id: str, out: CompletionDelta | None = None) -> _Open | None:
        """The span of a request seen for the first time: from the scheduler's request, or from its output when it
        finished in the step that first scheduled it (the scheduler has let it go: no priority then)."""
        request = engine.scheduler.requests.get(request_id)
        if request is not None:
            arrival_s, prompt_tokens = request.arrival_time, request.num_prompt_tokens
            extra = {"batchserve.request.priority": request.priority,
                     "gen_ai.request.max_tokens": request.sampling_params.max_tokens}  # fmt: skip
        elif out is not None:
            arrival_s, prompt_tokens, extra = out.metrics.arrival_time, out.num_prompt_tokens, {}
        else:
            return None
        arrival = self._ns(arrival_s)
        span = self.tracer.start_span(SPAN_NAME, context=self._parent(request_id), kind=SpanKind.SERVER,
                                      start_time=arrival)  # fmt: skip
        span.set_attributes({"gen_ai.request.id": request_id, "gen_ai.usage.prompt_tokens": prompt_tokens, **extra})
        span.add_event("queued", timestamp=arrival)
        entry = self._open[request_id] = _Open(span)
        return entry

    def _mark_preemptions(self, engine: LLMEngine, at_ns: int) -> None:
        for request_id, entry in self._open.items():
            request = engine.scheduler.requests.get(request_id)
            if request is not None and request.num_preemptions > entry.preemptions:
                entry.preemptions = request.num_preemptions
                entry.span.add_event("preempted", {"preemptions": entry.preemptions}, timestamp=at_ns)

    def _on_output(self, engine: LLMEngine, out: CompletionDelta) -> None:
        entry = self._open.get(out.request_id) or self._start(engine, out.request_id, out)
        if entry is None:
            return
        m = out.metrics
        if m.first_token_time is not None and not entry.first_token_seen:
            entry.first_token_seen = True
            entry.span.add_event("first_token", timestamp=self._ns(m.first_token_time))
        if out.finished:
            self._finish(out, entry)

    def _finish(self, out: CompletionDelta, entry: _Open) -> None:
        m, span = out.metrics, entry.span
        end = self._ns(m.finished_time if m.finished_time is not None else time.monotonic())
        attributes: dict[str, Any] = {
            "gen_ai.usage.completion_tokens": out.num_output_tokens,
            "gen_ai.usage.prompt_tokens": out.num_prompt_tokens,
            "batchserve.request.cached_tokens": m.num_cached_tokens,
            "batchserve.request.preemptions": m.num_preemptions,
            "gen_ai.response.finish_reasons": [str(out.finish_reason or "abort")],
        }
        if m.first_token_time is not None:
            attributes["gen_ai.latency.time_to_first_token"] = m.first_token_time - m.arrival_time
        if m.first_scheduled_time is not None:
            attributes["gen_ai.latency.time_in_queue"] = m.first_scheduled_time - m.arrival_time
        span.set_attributes(attributes)
        span.add_event("finished", {"finish_reason": str(out.finish_reason or "abort")}, timestamp=end)
        if out.finish_reason in (None, "abort"):
            span.set_status(Status(StatusCode.ERROR, "aborted"))
        span.end(end_time=end)
        del self._open[out.request_id]

    def _sweep(self, engine: LLMEngine) -> None:
        for request_id in [rid for rid in self._open if rid not in engine.scheduler.requests]:
            entry = self._open.pop(request_id)
            entry.span.set_status(Status(StatusCode.ERROR, "ended without a final output"))
            entry.span.end()

    def _ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self._wall_offset_ns
