"""Request deadlines over HTTP on the model-free engine: a request's own `timeout`, or the server's
request_timeout (--request-timeout), ends a running or a still-queued request with a 408 (or an error event in a
stream) and frees its KV blocks; a request that finishes in time is untouched."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from batchserve.config import ConfigError, EngineConfig
from tests.server.fakes import fake_engine
from tests.server.live import start_server

SLOW = 0.02  # seconds per engine step: 300 tokens take ~6 s


@pytest.fixture(scope="module")
def server():
    server = start_server(fake_engine(delay_s=SLOW, max_batch_size=1, max_model_len=512))
    yield server
    server.stop()


def _chat(max_tokens: int, **extra) -> dict:
    return {"messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens, "ignore_eos": True, **extra}


def _assert_idle(server) -> None:
    server.wait_idle()
    stats = server.engine.last_stats
    assert stats.kv_blocks_used == 0 and stats.num_running == 0 and stats.num_waiting == 0


def test_a_running_request_past_its_timeout_is_a_408_and_frees_its_blocks(server):
    start = time.monotonic()
    answer = httpx.post(server.url + "/v1/chat/completions", json=_chat(300, timeout=0.5), timeout=30)
    assert answer.status_code == 408, answer.text
    error = answer.json()["error"]
    assert error["code"] == "request_timeout" and error["param"] == "timeout" and "0.5 s" in error["message"]
    assert time.monotonic() - start < 3
    _assert_idle(server)


def test_a_queued_request_times_out_while_another_runs(server):
    with httpx.Client(timeout=30) as client:
        long = threading.Thread(target=client.post, args=(server.url + "/v1/completions",),
                                kwargs={"json": {"prompt": "x", "max_tokens": 60, "ignore_eos": True}})  # fmt: skip
        long.start()
        time.sleep(0.2)  # the long one holds the only batch slot (max_batch_size=1)
        queued = client.post(server.url + "/v1/completions",
                             json={"prompt": "y", "max_tokens": 4, "ignore_eos": True, "timeout": 0.3})  # fmt: skip
        assert queued.status_code == 408, queued.text
        long.join()
    _assert_idle(server)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses", "/v1/messages"])
def test_a_stream_past_its_timeout_ends_with_an_error_event(server, path):
    model = server.model_id()
    bodies = {
        "/v1/chat/completions": _chat(300, timeout=0.4, stream=True),
        "/v1/responses": {"input": "hi", "max_output_tokens": 300, "timeout": 0.4, "stream": True},
        "/v1/messages": {"model": model, "max_tokens": 300, "timeout": 0.4, "stream": True,
                         "messages": [{"role": "user", "content": "hi"}]},
    }  # fmt: skip
    answer = httpx.post(server.url + path, json=bodies[path], timeout=30)
    assert answer.status_code == 200
    events = [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: {")]
    last = events[-1]
    message = (last.get("error") or {}).get("message") or last.get("message") or ""
    assert "timeout of 0.4 s" in message, last
    _assert_idle(server)


def test_a_request_that_finishes_in_time_is_untouched(server):
    answer = httpx.post(server.url + "/v1/chat/completions", json=_chat(5, timeout=10.0), timeout=30)
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 5


@pytest.mark.parametrize("timeout", [0, -1.5])
def test_a_timeout_that_is_not_positive_is_a_400(server, timeout):
    answer = httpx.post(server.url + "/v1/chat/completions", json=_chat(2, timeout=timeout), timeout=30)
    assert answer.status_code == 400 and answer.json()["error"]["param"] == "timeout"


def test_the_server_default_applies_to_requests_without_their_own():
    server = start_server(fake_engine(delay_s=SLOW, request_timeout=0.4))
    try:
        answer = httpx.post(server.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 300}, timeout=30)
        assert answer.status_code == 408 and "0.4 s" in answer.json()["error"]["message"]
        own = httpx.post(server.url + "/v1/chat/completions", json=_chat(40, timeout=30.0), timeout=30)
        assert own.status_code == 200  # its own timeout wins over the server's
        _assert_idle(server)
    finally:
        server.stop()


def test_request_timeout_option_is_checked():
    assert EngineConfig.from_options(request_timeout=2.5).scheduler.request_timeout == 2.5
    with pytest.raises(ConfigError):
        EngineConfig.from_options(request_timeout=0)


def test_grpc_requests_get_the_server_default_as_deadline_exceeded():
    import grpc

    from batchserve.entrypoints.grpc.pb import generation_pb2 as pb
    from tests.server.grpc_live import LiveGrpc

    http = start_server(fake_engine(delay_s=SLOW, request_timeout=0.4), served_model_name=["fake"])
    live = LiveGrpc(http.async_engine, ["fake"])
    try:
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=300, ignore_eos=True))
        with pytest.raises(grpc.RpcError) as info:
            list(live.generation.Generate(request, timeout=30))
        assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "0.4 s" in info.value.details()
        _assert_idle(http)
    finally:
        live.stop()
        http.stop()
