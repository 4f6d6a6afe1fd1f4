"""Slow and idle sockets are closed (header and body read deadlines, keep-alive timeout) and a request read in
time is served whatever the app then takes."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
import time

import httpx
import pytest
import uvicorn

from batchserve.entrypoints.openai.app import build_app
from batchserve.entrypoints.openai.connections import ConnectionLimits
from batchserve.entrypoints.openai.front import DEFAULT_MAX_BODY_BYTES
from tests.server.fakes import fake_engine

LIMITS = ConnectionLimits(header_timeout_s=0.6, body_timeout_s=0.6, keep_alive_timeout_s=0.6, max_connections=64,
                          body_read_timeout_s=1.5)  # fmt: skip


def serving(limits: ConnectionLimits):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(build_app(fake_engine(delay_s=0.005)), log_level="warning", **limits.uvicorn_options())
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def port():
    yield from serving(LIMITS)


@pytest.fixture(scope="module")
def protocol_port():
    """Oversized bodies refused by the HTTP protocol from their Content-Length (as `serve` sets it up)."""
    yield from serving(dataclasses.replace(LIMITS, max_body_bytes=DEFAULT_MAX_BODY_BYTES))


@pytest.fixture(params=["protocol", "app"])
def refusing_port(request, port, protocol_port):
    """The protocol's refusal, or the app's (a server whose protocol is not told the limit)."""
    return protocol_port if request.param == "protocol" else port


def seconds_until_closed(port: int, first: bytes, limit_s: float = 10.0) -> float:
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.settimeout(limit_s)
        start = time.monotonic()
        conn.sendall(first)
        data = b""
        while chunk := conn.recv(4096):  # until the server closes (or the timeout raises)
            data += chunk
        return time.monotonic() - start


def test_half_a_request_line_is_disconnected_after_the_header_timeout(port):
    assert 0.5 <= seconds_until_closed(port, b"GET /hea") < 3.0


def test_a_stalled_body_is_disconnected_after_the_body_timeout(port):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    assert 0.5 <= seconds_until_closed(port, head + b'{"prompt":') < 3.0


def test_a_body_trickled_a_byte_at_a_time_is_cut_with_a_408(port):
    # never a gap long enough for the body timeout, so only the whole read's deadline stops it (it was never cut)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
    with socket.create_connection(("127.0.0.1", port)) as conn:
        conn.settimeout(0.2)
        start = time.monotonic()
        conn.sendall(head)
        answer = b""
        while time.monotonic() - start < 10:
            try:
                conn.sendall(b" ")  # a byte every 0.2 s, well inside the 0.6 s body timeout
            except OSError:
                break  # the server closed the connection
            try:
                chunk = conn.recv(4096)
            except TimeoutError:
                continue
            except OSError:
                break
            if not chunk:
                break
            answer += chunk
        elapsed = time.monotonic() - start
    assert 1.4 <= elapsed < 4.0, elapsed
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"did not arrive in time" in answer


def test_the_body_read_timeout_is_a_serve_flag():
    from batchserve.entrypoints.openai.launch import connection_limits_from_args, make_parser

    args = make_parser().parse_args(["--body-read-timeout", "12.5", "--body-timeout", "3"])
    limits = connection_limits_from_args(args)
    assert (limits.body_read_timeout_s, limits.body_timeout_s) == (12.5, 3)


def test_an_idle_keep_alive_connection_is_closed(port):
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    assert 0.5 <= seconds_until_closed(port, request) < 3.0


def test_a_request_read_in_time_is_served_past_the_deadlines(port):
    # a completion that runs longer than every deadline: reading is over, so nothing times it out
    response = httpx.post(
        f"http://127.0.0.1:{port}/v1/completions",
        timeout=30,
        json={"prompt": "hi", "max_tokens": 200, "ignore_eos": True, "stream": True},
    )
    assert response.status_code == 200 and response.text.rstrip().endswith("data: [DONE]")


def test_connections_over_the_cap_are_answered_503(port):
    idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(LIMITS.max_connections)]
    try:
        time.sleep(0.1)
        assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 503
    finally:
        for sock in idle:
            sock.close()
    time.sleep(0.2)
    assert httpx.get(f"http://127.0.0.1:{port}/health", timeout=10).status_code == 200


def test_the_connection_flags_reach_the_ray_ingress(monkeypatch):
    from batchserve.distributed import launch

    captured = {}
    monkeypatch.setattr(launch, "run", lambda options, *args, **kwargs: captured.setdefault("options", options) and 0)
    launch.main(["--replicas", "1", "--header-timeout", "7", "--body-timeout", "8", "--keep-alive-timeout", "9",
                 "--max-connections", "100"])  # fmt: skip
    options = captured["options"]
    assert (options.header_timeout_s, options.body_timeout_s, options.keep_alive_timeout_s) == (7, 8, 9)
    assert options.max_connections == 100


def test_an_oversized_content_length_is_refused_before_the_body_is_sent(refusing_port):
    # only the headers go out: the whole 413, saying the connection closes, must come back without a byte of the
    # body (the server then waits for the body it drains; the test does not wait for that)
    head = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n" % (DEFAULT_MAX_BODY_BYTES + 1))  # fmt: skip
    with socket.create_connection(("127.0.0.1", refusing_port)) as conn:
        conn.settimeout(10)  # a timeout here fails the test
        conn.sendall(head)
        answer = b""
        while b"\r\n\r\n" not in answer or len(answer.partition(b"\r\n\r\n")[2]) < _content_length(answer):
            chunk = conn.recv(4096)
            assert chunk, answer
            answer += chunk
        if b"connection: close" not in answer.lower():  # no header saying so: the server closes at once instead
            while chunk := conn.recv(4096):
                answer += chunk
    status, _, rest = answer.partition(b"\r\n")
    assert status == b"HTTP/1.1 413 Request Entity Too Large", answer
    assert b'"code":"body_too_large"' in rest


def _content_length(answer: bytes) -> int:
    for line in answer.partition(b"\r\n\r\n")[0].split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            return int(value)
    return 0


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/messages"])
def test_an_async_client_sending_an_oversized_body_anyway_reads_the_413(protocol_port, path):
    # an asyncio client writing the whole body before it reads (httpx's, the OpenAI and Anthropic SDKs') loses an
    # answer that a reset overtakes: it must read the 413, in its API's error shape, and be served next
    async def run() -> None:
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{protocol_port}", timeout=30) as client:
            for _ in range(2):
                refused = await client.post(path, content=b"[" + b"1," * (DEFAULT_MAX_BODY_BYTES // 2) + b"1]",
                                            headers={"content-type": "application/json"})  # fmt: skip
                assert refused.status_code == 413 and refused.headers["connection"] == "close"
                error = refused.json()["error"]
                assert error["type"] == ("request_too_large" if path == "/v1/messages" else "invalid_request_error")
            ok = await client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert ok.status_code == 200

    asyncio.run(run())


def test_a_refused_body_drains_past_the_header_timeout(protocol_port):
    # a body sent slower than the header timeout allows for headers is still drained to its end (a reset would
    # lose the 413 for a client still writing), and the connection closes once it is all in
    size = DEFAULT_MAX_BODY_BYTES + 1
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % size
    piece = size // 8 + 1
    with socket.create_connection(("127.0.0.1", protocol_port)) as conn:
        conn.settimeout(10)
        conn.sendall(head)
        sent = 0
        while sent < size:  # over 1.2 s: twice the 0.6 s header timeout
            time.sleep(0.15)
            chunk = b"x" * min(piece, size - sent)
            conn.sendall(chunk)  # a reset would raise here
            sent += len(chunk)
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 413 "), answer
