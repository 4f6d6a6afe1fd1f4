"""Service-level targets over HTTP: bad values are a 400 naming the field, a request the engine predicts cannot
meet its TTFT target is a 503 with Retry-After, and /metrics counts finished requests that met / missed theirs."""

from __future__ import annotations

import time

import httpx
import pytest

from batchserve.core.slo import FixedStepCost
from tests.server.fakes import fake_engine
from tests.server.live import start_server


@pytest.fixture(scope="module")
def server():
    engine = fake_engine(slo_admission="refuse")
    engine.scheduler.slo.cost = FixedStepCost(fixed_s=1.0, per_token_s=0.0)  # every step is predicted to take 1 s
    s = start_server(engine)
    yield s
    s.stop()


@pytest.mark.parametrize(
    "field, value",
    [("ttft_slo_ms", -5), ("ttft_slo_ms", 0), ("tpot_slo_ms", "fast"), ("tpot_slo_ms", -0.1), ("deadline", "soon"),
     ("deadline", 0)],
)  # fmt: skip
def test_a_bad_target_is_a_400_naming_the_field(server, field, value):
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2, field: value})
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"]["param"] == field


def test_a_deadline_already_past_is_a_400(server):
    body = {"prompt": "a", "max_tokens": 2, "deadline": time.time() - 5}
    reply = httpx.post(server.url + "/v1/completions", json=body)
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "deadline"


def test_a_target_the_engine_cannot_meet_is_a_503_with_retry_after(server):
    reply = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2, "ttft_slo_ms": 100})
    assert reply.status_code == 503, reply.text
    assert "TTFT target" in reply.json()["error"]["message"]
    # predicted ~1 s late (one modelled step of 1 s against a 0.1 s target): retry in about that
    assert int(reply.headers["Retry-After"]) == 1


def test_retry_after_follows_how_late_the_engine_predicts(server):
    body = {"prompt": "a", "max_tokens": 2, "ttft_slo_ms": 100}
    server.engine.scheduler.slo.cost = FixedStepCost(fixed_s=5.0, per_token_s=0.0)
    try:
        reply = httpx.post(server.url + "/v1/completions", json=body)
    finally:
        server.engine.scheduler.slo.cost = FixedStepCost(fixed_s=1.0, per_token_s=0.0)
    assert reply.status_code == 503 and int(reply.headers["Retry-After"]) == 5


def test_goodput_is_counted_in_the_metrics(server):
    hopeless = {"prompt": "a", "max_tokens": 2, "ttft_slo_ms": 100}
    assert httpx.post(server.url + "/v1/completions", json=hopeless).status_code == 503
    body = {"prompt": "a", "max_tokens": 2, "ignore_eos": True, "ttft_slo_ms": 60_000, "tpot_slo_ms": 60_000}
    assert httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code == 200
    metrics = httpx.get(server.url + "/metrics").text
    met = [line for line in metrics.splitlines() if line.startswith("batchserve:request_slo_total") and "met" in line]
    assert met and float(met[0].split()[-1]) >= 1.0, metrics
    refused = [line for line in metrics.splitlines() if line.startswith("batchserve:slo_admission_total")
               and 'decision="refused"' in line]  # fmt: skip
    assert refused and float(refused[0].split()[-1]) >= 1.0  # the 503 above, counted at the next step


def test_grpc_carries_the_targets_and_checks_them():
    from batchserve.entrypoints.grpc.params import sampling_params
    from batchserve.entrypoints.grpc.pb import generation_pb2 as pb
    from batchserve.sampling_params import InvalidRequestError

    params = sampling_params(pb.SamplingParams(ttft_slo_ms=250, tpot_slo_ms=40), 16)
    assert (params.ttft_slo_ms, params.tpot_slo_ms, params.deadline) == (250, 40, None)
    with pytest.raises(InvalidRequestError) as error:
        sampling_params(pb.SamplingParams(tpot_slo_ms=-1), 16)
    assert error.value.param == "tpot_slo_ms"


def test_kserve_generate_carries_the_targets(server):
    url = server.url + "/v2/models/ensemble/generate"
    bad = httpx.post(url, json={"text_input": "a", "max_tokens": 2, "ttft_slo_ms": -1}, timeout=30)
    assert bad.status_code == 400 and "ttft_slo_ms" in bad.json()["error"]
    hopeless = httpx.post(url, json={"text_input": "a", "max_tokens": 2, "ttft_slo_ms": 100}, timeout=30)
    assert hopeless.status_code == 503  # the same prediction as the OpenAI routes'
