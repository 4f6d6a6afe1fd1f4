"""Repeat offenders' 4xx answers wait (error_delay.py); served requests, and clients with a clean record, never do."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi.testclient import TestClient

from batchserve.entrypoints.grpc.error_delay import peer_address
from batchserve.entrypoints.openai import launch
from batchserve.entrypoints.openai.app import build_app
from batchserve.entrypoints.openai.connections import ConnectionLimits
from batchserve.entrypoints.openai.error_delay import (
    FIRST_DELAY_S,
    ErrorDelayConfig,
    ErrorDelayMiddleware,
    OffenderTable,
)
from batchserve.entrypoints.openai.front import DEFAULT_MAX_BODY_BYTES
from batchserve.serving.metrics import parse_metrics
from tests.server.fakes import fake_engine

BAD = {"prompt": "hi", "max_tokens": -1}
GOOD = {"prompt": "hi", "max_tokens": 2}


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_delays_start_after_the_free_refusals_double_and_stop_at_the_cap():
    table = OffenderTable(ErrorDelayConfig(max_delay_s=0.3, after=3), clock=Clock())
    delays = [table.refused("10.0.0.1") for _ in range(9)]
    assert delays[:3] == [0.0, 0.0, 0.0]
    assert delays[3:7] == [FIRST_DELAY_S, 2 * FIRST_DELAY_S, 4 * FIRST_DELAY_S, 0.3]
    assert delays[7:] == [0.3, 0.3]
    assert table.refused("10.0.0.2") == 0.0  # another address has its own record
    assert table.delayed_total == 6 and table.delay_seconds_total == pytest.approx(sum(delays))


def test_a_client_that_stops_offending_is_forgiven():
    clock = Clock()
    table = OffenderTable(ErrorDelayConfig(max_delay_s=5, after=3, half_life_s=10), clock=clock)
    for _ in range(20):
        table.refused("10.0.0.1")
    assert table.refused("10.0.0.1") == 5
    clock.now += 100  # ten half-lives: 21 refusals count as 0.02
    assert table.refused("10.0.0.1") == 0.0


def test_the_table_is_bounded_and_drops_the_least_recently_refused():
    table = OffenderTable(ErrorDelayConfig(max_delay_s=1, after=0, max_clients=3), clock=Clock())
    for i in range(1000):
        table.refused(f"10.0.{i // 256}.{i % 256}")
    assert len(table) == 3
    table.refused("10.0.3.229")  # among the three kept: its record goes on
    table.refused("10.9.9.9")  # a newcomer pushes out the least recently refused
    assert len(table) == 3 and set(table._clients) == {"10.0.3.231", "10.0.3.229", "10.9.9.9"}


def test_off_and_anonymous_clients_are_never_delayed():
    off = OffenderTable(ErrorDelayConfig(max_delay_s=0, after=0))
    assert [off.refused("10.0.0.1") for _ in range(50)] == [0.0] * 50 and len(off) == 0
    on = OffenderTable(ErrorDelayConfig(max_delay_s=1, after=0))
    assert on.refused(None) == 0.0


@pytest.mark.parametrize("flag", ["--error-delay-max", "--error-delay-after", "--error-delay-clients"])
def test_a_bad_setting_is_refused_naming_its_flag(flag, capsys):
    with pytest.raises(SystemExit):
        launch.main([flag, "-1"])
    assert flag in capsys.readouterr().err


def _timed(client: TestClient, body: dict) -> tuple[int, float]:
    start = time.monotonic()
    status = client.post("/v1/completions", json=body).status_code
    return status, time.monotonic() - start


def test_the_offender_waits_and_a_clean_client_at_the_same_address_does_not():
    delay = 0.4
    offenders = OffenderTable(ErrorDelayConfig(max_delay_s=delay, after=2))
    app = build_app(fake_engine(), offenders=offenders)
    with TestClient(app, client=("10.1.1.1", 1111)) as offender, TestClient(app, client=("10.1.1.1", 2222)) as clean:
        quick = [_timed(offender, BAD) for _ in range(2)]
        assert all(status == 400 and took < delay / 2 for status, took in quick), quick
        for _ in range(5):  # 0.05, 0.1, 0.2, then the cap
            _timed(offender, BAD)
        status, took = _timed(offender, BAD)
        assert status == 400 and took >= delay
        served = [_timed(clean, GOOD) for _ in range(3)]  # the same address, well-formed requests
        assert all(status == 200 and took < delay / 2 for status, took in served), served
        with TestClient(app, client=("10.2.2.2", 1)) as elsewhere:
            assert _timed(elsewhere, BAD)[1] < delay / 2  # another address's first refusal: at once
        metrics = parse_metrics(clean.get("/metrics").text)
    assert metrics["batchserve:error_responses_delayed_total"] == 6
    assert metrics["batchserve:error_delay_seconds_total"] == pytest.approx(0.05 + 0.1 + 0.2 + 3 * delay)
    assert metrics["batchserve:error_delay_clients"] == 2


def test_a_key_guesser_waits_for_its_401s():
    offenders = OffenderTable(ErrorDelayConfig(max_delay_s=0.3, after=1))
    with TestClient(build_app(fake_engine(), api_key="k", offenders=offenders)) as client:
        statuses = [client.get("/v1/models", headers={"Authorization": "Bearer guess"}).status_code for _ in range(4)]
        assert statuses == [401] * 4 and offenders.delayed_total == 3
        assert client.get("/v1/models", headers={"Authorization": "Bearer k"}).status_code == 200


def test_a_repeat_offenders_protocol_level_413_waits_and_still_arrives():
    # the 413 the protocol answers from Content-Length alone: held back like the app's 4xx, and the connection is
    # not closed before it has gone out even when the body has all arrived meanwhile
    delay = 0.5
    offenders = OffenderTable(ErrorDelayConfig(max_delay_s=delay, after=1))
    app = build_app(fake_engine(), offenders=offenders)
    limits = ConnectionLimits(max_body_bytes=DEFAULT_MAX_BODY_BYTES)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **limits.uvicorn_options(offenders)))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    body = b"[" + b"1," * (DEFAULT_MAX_BODY_BYTES // 2) + b"1]"

    async def run() -> list[tuple[int, float]]:
        answers = []
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}", timeout=30) as client:
            for _ in range(3):
                start = time.monotonic()
                response = await client.post("/v1/completions", content=body)
                answers.append((response.status_code, time.monotonic() - start))
            start = time.monotonic()
            served = await client.post("/v1/completions", json=GOOD)
            answers.append((served.status_code, time.monotonic() - start))
        return answers

    try:
        answers = asyncio.run(run())
    finally:
        server.should_exit = True
        thread.join(30)
    assert [status for status, _ in answers] == [413, 413, 413, 200], answers
    assert answers[0][1] < FIRST_DELAY_S + 0.5 and answers[2][1] >= 2 * FIRST_DELAY_S
    assert answers[3][1] < delay and offenders.delayed_total == 2


@pytest.mark.parametrize(("status", "waits"), [(400, True), (404, True), (413, True), (422, True), (200, False),
                                               (499, False), (500, False), (503, False)])  # fmt: skip
def test_only_4xx_answers_wait(status, waits):
    # an offender well past its free refusals: only a 4xx answer is held back (a 499 has nobody to answer; a 503
    # carries Retry-After; a 5xx is the server's fault)
    async def answer(scope, receive, send):
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    offenders = OffenderTable(ErrorDelayConfig(max_delay_s=0.3, after=0))
    for _ in range(20):
        offenders.refused("testclient")
    client = TestClient(ErrorDelayMiddleware(answer, offenders))  # no lifespan: the toy app answers requests only
    start = time.monotonic()
    assert client.get("/").status_code == status
    took = time.monotonic() - start
    assert (took >= 0.3) == waits and offenders.delayed_total == 20 + waits


@pytest.mark.parametrize(
    ("peer", "address"),
    [("ipv4:127.0.0.1:5000", "127.0.0.1"), ("ipv6:[::1]:5000", "::1"), ("unix:/tmp/s", "/tmp/s"), (None, None)],
)
def test_grpc_peers_are_keyed_by_address_as_http_clients_are(peer, address):
    assert peer_address(peer) == address


def test_a_grpc_repeat_offender_waits_for_invalid_argument_and_a_valid_call_does_not():
    import grpc

    from batchserve.engine.async_engine import AsyncLLMEngine
    from batchserve.entrypoints.grpc.pb import generation_pb2 as pb
    from tests.server.grpc_live import LiveGrpc

    delay = 0.4
    offenders = OffenderTable(ErrorDelayConfig(max_delay_s=delay, after=2))
    engine = AsyncLLMEngine(fake_engine())
    live = LiveGrpc(engine, ["fake"], offenders=offenders)
    bad = pb.GenerateRequest(text="x", sampling=pb.SamplingParams(max_tokens=2, stop_token_ids=[-3]))
    good = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2))
    try:
        took = []
        for _ in range(8):  # 2 free, then 0.05, 0.1, 0.2 and the cap
            start = time.monotonic()
            with pytest.raises(grpc.RpcError) as info:
                list(live.generation.Generate(bad, timeout=30))
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            took.append(time.monotonic() - start)
        assert max(took[:2]) < delay / 2 and min(took[-2:]) >= delay, took
        start = time.monotonic()
        (ok,) = live.generation.Generate(good, timeout=30)
        assert len(ok.token_ids) == 2 and time.monotonic() - start < delay
        assert offenders.delayed_total == 6 and len(offenders) == 1
    finally:
        live.stop()
        engine.shutdown()
