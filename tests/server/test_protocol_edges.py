"""The protocol edges a hostile client found, each answered as it should be: a refused duplicate gRPC
request_id leaves the running request abortable, deep nesting and NaN are 400s, a client gone mid-body logs no
error, the Bearer scheme is read in any case, and a second SIGTERM during a drain exits at once."""

from __future__ import annotations

import logging
import math
import signal
import socket
import textwrap
import time

import grpc
import httpx
import pytest

from batchserve.entrypoints.grpc.pb import generation_pb2 as pb
from batchserve.entrypoints.kserve.trtllm import parse_request
from tests.server.fakes import fake_engine
from tests.server.grpc_live import LiveGrpc
from tests.server.live import server_process, start_server
from tests.server.test_api import sse_events

KEY = "sekret"


@pytest.fixture(scope="module")
def servers():
    http = start_server(fake_engine(delay_s=0.002), served_model_name=["fake"], api_key=KEY)
    live = LiveGrpc(http.async_engine, ["fake"], api_key=KEY)
    yield http, live
    live.stop()
    http.stop()


def metadata(scheme: str = "Bearer") -> list[tuple[str, str]]:
    return [("authorization", f"{scheme} {KEY}")]


def test_a_refused_duplicate_request_id_leaves_the_running_request_abortable(servers):
    http, live = servers
    request = pb.GenerateRequest(request_id="dup", text="a", stream=True,
                                 sampling=pb.SamplingParams(max_tokens=150, ignore_eos=True))  # fmt: skip
    call = live.generation.Generate(request, timeout=30, metadata=metadata())
    next(call)
    with pytest.raises(grpc.RpcError) as info:
        list(live.generation.Generate(pb.GenerateRequest(request_id="dup", text="b"), timeout=30,
                                      metadata=metadata()))  # fmt: skip
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "in use" in info.value.details()
    aborted = live.generation.Abort(pb.AbortRequest(request_ids=["dup"]), metadata=metadata()).aborted_ids
    assert list(aborted) == ["dup"]
    assert list(call)[-1].finish_reason == "abort"


def test_a_triton_body_nested_900_deep_is_a_400(servers):
    http, _ = servers
    deep = "[" * 900 + '"x"' + "]" * 900
    body = '{"text_input": ' + deep + ', "max_tokens": 4}'
    reply = httpx.post(
        http.url + "/v2/models/ensemble/generate",
        content=body,
        timeout=30,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert reply.status_code == 400, reply.text


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_kserve_reads_a_non_finite_top_p_as_an_error_not_as_off(value):
    with pytest.raises(Exception) as info:
        parse_request({"text_input": ["x"], "max_tokens": [4], "top_p": [value]}, {}, [])
    assert "top_p" in str(info.value)


def test_a_client_gone_mid_body_logs_no_error(servers):
    http, _ = servers
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    loggers = [logging.getLogger(), logging.getLogger("uvicorn.error"), logging.getLogger("uvicorn")]
    for logger in loggers:
        logger.addHandler(handler)
    try:
        with socket.create_connection(("127.0.0.1", http.port)) as conn:
            conn.sendall(
                b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                + f"Authorization: Bearer {KEY}\r\nContent-Length: 400\r\n\r\n".encode()
                + b'{"prompt": "'
            )
            time.sleep(0.3)
        time.sleep(0.5)
        ok = httpx.get(http.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
        assert ok.status_code == 200
    finally:
        for logger in loggers:
            logger.removeHandler(handler)
    assert not records, [r.getMessage() for r in records]


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_read_in_any_case(servers, scheme):
    http, live = servers
    reply = httpx.get(http.url + "/v1/models", headers={"Authorization": f"{scheme} {KEY}"}, timeout=30)
    assert reply.status_code == 200
    (ok,) = live.generation.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2)),
                                     timeout=30, metadata=metadata(scheme))  # fmt: skip
    assert len(ok.token_ids) == 2


@pytest.mark.parametrize("authorization", [f"Basic {KEY}", f"Bearer {KEY}x", KEY, f"Bearer{KEY}", ""])
def test_anything_else_is_still_refused(servers, authorization):
    http, _ = servers
    reply = httpx.get(http.url + "/v1/models", headers={"Authorization": authorization}, timeout=30)
    assert reply.status_code == 401


SLOW_DRAIN_SCRIPT = textwrap.dedent(
    """
    import sys
    from batchserve.engine.async_engine import AsyncLLMEngine
    from batchserve.entrypoints.openai.app import build_app
    from batchserve.entrypoints.openai.launch import serve
    from tests.server.fakes import fake_engine
    async_engine = AsyncLLMEngine(fake_engine(delay_s=0.05))
    app = build_app(async_engine)
    sys.exit(serve(app, async_engine, port=int(sys.argv[1]), log_level="warning", drain_timeout=60))
    """
)


def test_a_second_sigterm_during_the_drain_exits_at_once():
    with server_process(SLOW_DRAIN_SCRIPT) as (proc, url):
        body = {"prompt": "a", "max_tokens": 200, "ignore_eos": True, "stream": True}  # ~10 s of steps
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            time.sleep(0.5)
            assert proc.poll() is None  # the first one drains (for up to 60 s)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            events = sse_events([first, *lines])
        assert proc.wait(10) == 1  # something was aborted: the exit status says so
        assert time.monotonic() - signalled < 5
        assert events[-1] == "[DONE]" and "error" in events[-2]


@pytest.mark.parametrize(
    "body",
    [b'{"prompt": "\\ud800"}', b'{"prompt": "\xed\xa0\x80"}', '{"prompt": "\ud800"}'.encode("utf-16", "surrogatepass")],
)
def test_a_lone_surrogate_is_a_400_however_it_is_written(servers, body):
    http, _ = servers
    reply = httpx.post(
        http.url + "/v1/completions",
        content=body,
        timeout=30,
        headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"},
    )
    assert reply.status_code == 400 and "surrogate" in reply.json()["error"]["message"]
