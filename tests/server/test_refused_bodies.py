"""A large body the parse refused is refused again, from memory, without a second parse (refused_bodies.py); the
refusal still waits in the offender table, and nothing that was served or refused after the parse is remembered."""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from batchserve.entrypoints.openai import bodies
from batchserve.entrypoints.openai.app import build_app
from batchserve.entrypoints.openai.error_delay import ErrorDelayConfig, OffenderTable
from batchserve.entrypoints.openai.errors import APIError
from batchserve.entrypoints.openai.refused_bodies import RefusedBodies
from tests.server.fakes import fake_engine

HUGE_BIAS = {"prompt": "x", "max_tokens": 2, "logit_bias": {str(i): 1 for i in range(100_000)}}
# the same, with an escape after the field: the scan of bounded fields steps aside (bounded_fields.py), the parse runs
ESCAPED_BIAS = {**HUGE_BIAS, "user": "caf\u00e9"}


@pytest.fixture
def parses(monkeypatch):
    """How many times the real parse of a large body ran."""
    calls = []
    real = bodies.validated_body

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(bodies, "validated_body", counted)
    return calls


def _post(client: TestClient, body: dict) -> tuple[int, dict]:
    response = client.post("/v1/completions", content=json.dumps(body), headers={"content-type": "application/json"})
    return response.status_code, response.json()


def test_a_repeat_offenders_huge_logit_bias_is_refused_without_a_second_parse(parses):
    offenders = OffenderTable(ErrorDelayConfig(max_delay_s=0.01, after=0))
    app = build_app(fake_engine(), offenders=offenders)
    with TestClient(app, client=("10.3.3.3", 1)) as client:
        answers = [_post(client, ESCAPED_BIAS) for _ in range(4)]
        assert len(parses) == 1
        assert all(status == 400 and answer == answers[0][1] for status, answer in answers), answers
        assert answers[0][1]["error"]["param"] == "logit_bias"
        assert offenders.delayed_total == 4  # the remembered refusals wait like the first
        assert app.state.front.body_parser.refused.hits == 3
        other = {**ESCAPED_BIAS, "logit_bias": {str(i): 2 for i in range(100_000)}}  # other bytes: parsed
        assert _post(client, other)[0] == 400 and len(parses) == 2


def test_a_huge_logit_bias_with_other_bytes_each_time_is_refused_from_a_scan_without_a_parse(parses):
    with TestClient(build_app(fake_engine())) as client:
        for bias in range(3):
            status, answer = _post(client, {**HUGE_BIAS, "logit_bias": {str(i): bias for i in range(100_000)}})
            assert status == 400 and answer["error"]["param"] == "logit_bias"
        assert len(parses) == 0


def test_served_bodies_and_refusals_after_the_parse_are_parsed_every_time(parses):
    with TestClient(build_app(fake_engine())) as client:
        large = {"prompt": "hi", "max_tokens": 2, "user": "u" * 100_000}
        assert [_post(client, large)[0] for _ in range(2)] == [200, 200]
        unknown_model = {**large, "model": "an-adapter-loaded-later"}  # 404 from the server's state, after the parse
        assert [_post(client, unknown_model)[0] for _ in range(2)] == [404, 404]
        assert len(parses) == 4
        assert len(client.app.state.front.body_parser.refused) == 0


def test_the_memory_is_bounded_and_keeps_only_refusals_of_the_body():
    memory = RefusedBodies(max_entries=2)
    keys = [("m", False, bytes([i])) for i in range(3)]
    for key in keys:
        memory.remember(key, APIError(400, "bad", param="logit_bias"))
    assert len(memory) == 2 and memory.refusal(keys[0]) is None
    again = memory.refusal(keys[2])
    assert (again.status, again.message, again.param) == (400, "bad", "logit_bias") and memory.hits == 1
    memory.remember(("m", False, b"x"), APIError(503, "queue full", headers={"Retry-After": "1"}))
    memory.remember(("m", True, b"y"), APIError(429, "later", headers={"Retry-After": "1"}))
    assert memory.refusal(("m", False, b"x")) is None and memory.refusal(("m", True, b"y")) is None
    assert memory.refusal(("m", True, bytes([2]))) is None  # lenient is part of the key
