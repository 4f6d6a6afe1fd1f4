"""Service-level targets as request properties: validated at the edge, resolved against the server's defaults, and
counted as met or missed when a request finishes (goodput)."""

from __future__ import annotations

import time

import pytest

from batchserve.config import ConfigError, SchedulerConfig
from batchserve.engine.outputs import RequestMetrics
from batchserve.request import EngineRequest, Request
from batchserve.sampling_params import InvalidRequestError, SamplingParams
from tests.core.helpers import make_request, make_scheduler


@pytest.mark.parametrize("field", ["ttft_slo_ms", "tpot_slo_ms", "deadline"])
@pytest.mark.parametrize("value", [-1.0, 0, 0.0, "500", float("nan"), float("inf"), True, None.__class__])
def test_a_bad_target_is_refused_naming_its_field(field, value):
    with pytest.raises(InvalidRequestError) as error:
        SamplingParams(**{field: value})
    assert error.value.param == field


def test_a_deadline_already_past_is_refused_at_once():
    with pytest.raises(InvalidRequestError, match="already passed") as error:
        SamplingParams(deadline=time.time() - 1)
    assert error.value.param == "deadline"
    SamplingParams(deadline=time.time() + 60)  # a future one is fine


def test_the_request_s_own_targets_win_over_the_server_s():
    scheduler = make_scheduler(ttft_slo_ms=500, tpot_slo_ms=50)
    own, default = make_request("own", ttft_slo_ms=200), make_request("default")
    scheduler.add_request(own)
    scheduler.add_request(default)
    assert (own.ttft_slo_s, own.tpot_slo_s) == (0.2, 0.05)
    assert (default.ttft_slo_s, default.tpot_slo_s) == (0.5, 0.05)
    plain = make_request("plain")
    make_scheduler().add_request(plain)
    assert plain.ttft_slo_s is None and plain.tpot_slo_s is None


def test_a_wall_clock_deadline_lands_on_the_engine_s_clock():
    params = SamplingParams(deadline=time.time() + 2.0)
    request = Request.of(EngineRequest("r", [1, 2, 3], params, arrival_time=100.0), ())
    assert request.deadline == pytest.approx(102.0, abs=0.05)


@pytest.mark.parametrize(
    "options, message",
    [
        (dict(ttft_slo_ms=0), "ttft_slo_ms"),
        (dict(tpot_slo_ms=-5), "tpot_slo_ms"),
        (dict(long_prefill_token_threshold=-1), "long_prefill_token_threshold"),
        (dict(max_long_partial_prefills=0), "max_long_partial_prefills"),
        (dict(max_preemptions_per_request=0), "max_preemptions_per_request"),
        (dict(slo_admission="sometimes"), "slo_admission"),
    ],
)
def test_server_defaults_are_checked(options, message):
    with pytest.raises(ConfigError, match=message):
        SchedulerConfig(**options).validate()


def test_slo_met_reads_both_targets():
    on_time = RequestMetrics(arrival_time=0.0, first_token_time=0.1, finished_time=1.0, ttft_slo_s=0.2, tpot_slo_s=0.1)
    assert on_time.slo_met(11) is True  # 0.9 s over 10 gaps: 90 ms a token
    assert on_time.slo_met(5) is False  # 0.9 s over 4 gaps: 225 ms a token
    late = RequestMetrics(arrival_time=0.0, first_token_time=0.3, finished_time=0.3, ttft_slo_s=0.2)
    assert late.slo_met(1) is False
    assert RequestMetrics(arrival_time=0.0, ttft_slo_s=0.2).slo_met(0) is False  # never produced a token
    assert RequestMetrics(arrival_time=0.0, first_token_time=9.0).slo_met(3) is None  # no targets: not counted
