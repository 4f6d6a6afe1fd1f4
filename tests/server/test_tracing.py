"""Request traces (OpenTelemetry SDK, in-memory exporter and an OTLP receiver on loopback), X-Request-Id, and the JSON
access log, on a live server over the fake engine."""

from __future__ import annotations

import json
import logging
import math
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, HTTPServer

import httpx
import pytest

pytest.importorskip("opentelemetry.sdk")

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest  # noqa: E402
from opentelemetry.sdk.trace import TracerProvider  # noqa: E402
from opentelemetry.sdk.trace.export import SimpleSpanProcessor  # noqa: E402
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

from batchserve.entrypoints.openai.access_log import AccessLog, JsonFormatter  # noqa: E402
from batchserve.entrypoints.openai.launch import make_parser  # noqa: E402
from batchserve.entrypoints.openai.observability import observability_from_args  # noqa: E402
from batchserve.serving.tracing import RequestTracer, otlp_exporter, tracer_provider  # noqa: E402
from tests.server.fakes import fake_engine  # noqa: E402
from tests.server.live import start_server  # noqa: E402

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01"


def in_memory_tracer() -> tuple[RequestTracer, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return RequestTracer(provider), exporter


def names(span) -> list[str]:
    return [event.name for event in span.events]


def test_a_span_per_request_child_of_the_callers_with_its_events():
    tracer, exporter = in_memory_tracer()
    server = start_server(fake_engine(max_num_tokens=16), tracer=tracer)
    try:
        body = {"prompt": "y" * 40, "max_tokens": 5, "ignore_eos": True, "priority": 3}
        headers = {"traceparent": TRACEPARENT, "X-Request-Id": "my-req-1"}
        response = httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=30)
        assert response.status_code == 200
        assert response.headers["x-request-id"] == "my-req-1" and response.json()["id"] == "my-req-1"
        server.wait_idle()
    finally:
        server.stop()
    (span,) = exporter.get_finished_spans()
    assert span.name == "llm_request"
    assert format(span.context.trace_id, "032x") == TRACE_ID
    assert format(span.parent.span_id, "016x") == PARENT_SPAN_ID
    attrs = span.attributes
    prompt_tokens = attrs["gen_ai.usage.prompt_tokens"]
    assert attrs["gen_ai.request.id"] == "my-req-1" and attrs["batchserve.request.priority"] == 3
    assert attrs["gen_ai.usage.completion_tokens"] == 5 and attrs["batchserve.request.cached_tokens"] == 0
    events = names(span)
    assert events[0] == "queued" and events[-1] == "finished"
    chunks = [e for e in span.events if e.name == "prefill_chunk"]
    assert len(chunks) == math.ceil(prompt_tokens / 16)  # the 16-token budget cuts the prompt into chunks
    assert sum(e.attributes["tokens"] for e in chunks) == prompt_tokens
    assert events.index("first_token") > events.index("prefill_chunk")
    times = [e.timestamp for e in span.events]
    assert times == sorted(times) and span.start_time <= times[0] and times[-1] <= span.end_time


def test_preemptions_are_events_and_requests_without_traceparent_are_roots():
    tracer, exporter = in_memory_tracer()
    server = start_server(fake_engine(num_kv_blocks=8, max_batch_size=8), tracer=tracer)
    try:

        def one(i: int) -> None:
            body = {"prompt": "z" * (20 + i), "max_tokens": 30, "ignore_eos": True}
            assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200

        with ThreadPoolExecutor(6) as pool:
            list(pool.map(one, range(6)))
        server.wait_idle()
        preempted_total = server.metrics()["batchserve:num_preemptions_total"]
    finally:
        server.stop()
    spans = exporter.get_finished_spans()
    assert len(spans) == 6 and all(span.parent is None for span in spans)
    assert preempted_total > 0, "8 blocks for 6 requests of ~50 tokens must preempt"
    for span in spans:
        assert names(span).count("preempted") == span.attributes["batchserve.request.preemptions"]
    assert sum(names(s).count("preempted") for s in spans) == preempted_total


class _Receiver(BaseHTTPRequestHandler):
    received: list[ExportTraceServiceRequest] = []

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        body = self.rfile.read(int(self.headers["Content-Length"]))
        request = ExportTraceServiceRequest()
        request.ParseFromString(body)
        self.received.append(request)
        self.send_response(200)
        self.send_header("Content-Type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def test_spans_reach_an_otlp_receiver_on_loopback():
    receiver = HTTPServer(("127.0.0.1", 0), _Receiver)
    thread = threading.Thread(target=receiver.serve_forever, daemon=True)
    thread.start()
    tracer = RequestTracer(tracer_provider(otlp_exporter(f"127.0.0.1:{receiver.server_port}")))
    server = start_server(fake_engine(), tracer=tracer)
    try:
        body = {"prompt": "hello", "max_tokens": 3, "ignore_eos": True}
        headers = {"traceparent": TRACEPARENT}
        assert httpx.post(server.url + "/v1/completions", json=body, headers=headers, timeout=30).status_code == 200
        server.wait_idle()
    finally:
        server.stop()
        tracer.shutdown()  # flushes the batch
        receiver.shutdown()
    spans = [s for r in _Receiver.received for rs in r.resource_spans for ss in rs.scope_spans for s in ss.spans]
    assert [s.name for s in spans] == ["llm_request"]
    assert spans[0].trace_id.hex() == TRACE_ID and spans[0].parent_span_id.hex() == PARENT_SPAN_ID
    assert {e.name for e in spans[0].events} >= {"queued", "prefill_chunk", "first_token", "finished"}


class _Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.setFormatter(JsonFormatter())
        self.lines: list[dict] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


def test_json_access_log_lines():
    logger = logging.getLogger("test.access")
    handler = _Lines()
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    server = start_server(fake_engine(), access_log=AccessLog(logger), api_key="k")
    try:
        auth = {"Authorization": "Bearer k"}
        body = {"prompt": "abcdef", "max_tokens": 4, "ignore_eos": True}
        ok = httpx.post(server.url + "/v1/completions", json=body, headers={**auth, "X-Request-Id": "r-1"}, timeout=30)
        stream = httpx.post(server.url + "/v1/completions", json={**body, "stream": True}, headers=auth, timeout=30)
        denied = httpx.post(server.url + "/v1/completions", json=body, timeout=30)
        assert (ok.status_code, stream.status_code, denied.status_code) == (200, 200, 401)
        server.wait_idle()
    finally:
        server.stop()
        logger.removeHandler(handler)
    by_status = {}
    for line in handler.lines:
        by_status.setdefault(line["status"], []).append(line)
    first, streamed = sorted(by_status[200], key=lambda line: line["request_id"] != "r-1")
    assert first["request_id"] == "r-1" and first["path"] == "/v1/completions" and first["method"] == "POST"
    for line in (first, streamed):
        assert line["output_tokens"] == 4 and line["prompt_tokens"] >= 6 and line["finish_reason"] == "length"
        assert 0 < line["ttft_s"] <= line["e2e_s"] <= line["duration_s"] + 0.05
    assert streamed["request_id"] == stream.headers["x-request-id"] and streamed["request_id"].startswith("cmpl-")
    (refused,) = by_status[401]
    assert "output_tokens" not in refused and refused["level"] == "info"


def test_the_serve_flags_build_the_tracer_and_the_access_log(monkeypatch):
    root = logging.getLogger()
    monkeypatch.setattr(root, "handlers", list(root.handlers))  # both restored after the test
    monkeypatch.setattr(root, "level", root.level)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        monkeypatch.setattr(logging.getLogger(name), "handlers", list(logging.getLogger(name).handlers))
        monkeypatch.setattr(logging.getLogger(name), "propagate", logging.getLogger(name).propagate)
    parser = make_parser()
    args = parser.parse_args(["--log-format", "json", "--otlp-traces-endpoint", "http://127.0.0.1:1/v1/traces"])
    options = observability_from_args(parser, args)
    assert isinstance(options["tracer"], RequestTracer) and isinstance(options["access_log"], AccessLog)
    assert isinstance(logging.getLogger().handlers[0].formatter, JsonFormatter)
    options["tracer"].provider.shutdown()
    plain = observability_from_args(parser, parser.parse_args([]))
    assert plain == {"tracer": None, "access_log": None}


def test_x_request_id_is_used_checked_and_echoed():
    server = start_server(fake_engine(delay_s=0.02))
    try:
        url, body = server.url + "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                          "max_tokens": 3}  # fmt: skip
        chat = httpx.post(url, json=body, headers={"X-Request-Id": "chat-7"}, timeout=30)
        assert chat.json()["id"] == "chat-7" and chat.headers["x-request-id"] == "chat-7"
        odd = httpx.post(url, json=body, headers={"X-Request-Id": "no spaces <allowed>"}, timeout=30)
        assert odd.status_code == 200 and odd.json()["id"].startswith("chatcmpl-")
        assert odd.headers["x-request-id"] == odd.json()["id"]
        with ThreadPoolExecutor(2) as pool:  # the same id twice at once: the second is refused while the first runs
            slow = {**body, "max_tokens": 60, "ignore_eos": True}
            replies = list(pool.map(lambda _: httpx.post(url, json=slow, headers={"X-Request-Id": "dup"}, timeout=30),
                                    range(2)))  # fmt: skip
        assert sorted(r.status_code for r in replies) == [200, 400]
        health = httpx.get(server.url + "/health", headers={"X-Request-Id": "probe-1"}, timeout=10)
        assert health.headers["x-request-id"] == "probe-1"
    finally:
        server.stop()
