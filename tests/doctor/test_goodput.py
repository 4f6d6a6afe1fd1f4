"""doctor's goodput rule on windows built step by step: a TPOT target missed in steps that carried long prefill
chunks names long-prompt isolation with a budget from the fitted step time; a TTFT target missed while requests
queued names SLO-aware admission; a window meeting its targets, or with none set, has no such finding."""

from __future__ import annotations

from batchserve.doctor.goodput import count_misses, targets_of
from batchserve.doctor.observe import Finished, Observation, Step
from batchserve.doctor.rules import diagnose

CONFIG = {"max_batch_size": 16, "max_num_tokens": 2048, "num_kv_blocks": 4096, "block_size": 16}
PER_STEP_S, PER_TOKEN_S = 0.002, 0.00005


def step(prefill: int, decodes: int, waiting: int = 0) -> Step:
    return Step(PER_STEP_S + PER_TOKEN_S * (prefill + decodes), prefill, decodes, decodes + bool(prefill), waiting,
                decodes + bool(prefill), 100, 0)  # fmt: skip


def long_chunks_window(**config) -> Observation:
    """Every third step carries a 1,000-token prompt beside 8 decodes: 52 ms against 2.4 ms without."""
    steps = [step(1000 if i % 3 == 0 else 0, 8) for i in range(90)]
    duration = sum(s.duration_s for s in steps)
    mean_step = duration / len(steps)
    requests = [Finished(32, 40, i * duration / 40, 0.01, 0.01 + 39 * mean_step) for i in range(32)]
    requests += [Finished(1000, 4, i * duration / 8, 0.06, 0.06 + 3 * mean_step) for i in range(8)]
    return Observation(duration, CONFIG | config, steps, requests)


def test_tpot_missed_beside_long_prefills_names_long_prompt_isolation():
    obs = long_chunks_window(tpot_slo_ms=15)
    misses = count_misses(obs, targets_of(obs))
    assert misses.tpot == 40 and misses.met == 0
    finding = next(f for f in diagnose(obs).findings if f.rule == "goodput_falls")
    change = finding.prediction.change
    # the most prompt tokens a step of 8 decodes can add and stay inside 15 ms: (0.015 - 0.002) / 0.00005 - 8 = 252
    assert abs(change["long_prefill_token_threshold"] - 252) <= 3 and change["max_long_partial_prefills"] == 1
    assert "long_prefill_token_threshold" in finding.change and "0 of 40 requests" in finding.evidence[0]
    # the simulator replays the window with and without the change and reports the share meeting the target
    assert {"slo_attainment"} <= finding.prediction.before.keys() & finding.prediction.after.keys()
    assert "meeting the SLO" in finding.prediction.describe()


def test_ttft_missed_in_a_queue_names_slo_admission():
    steps = [step(64, 15, waiting=10) for _ in range(60)]
    duration = sum(s.duration_s for s in steps)
    requests = [Finished(64, 16, i * duration / 40, 0.2 + 0.01 * i, 0.3 + 0.01 * i) for i in range(40)]
    obs = Observation(duration, CONFIG | {"ttft_slo_ms": 150}, steps, requests, in_flight_start=20,
                      in_flight_end=20, waiting_start=10, waiting_end=10)  # fmt: skip
    finding = next(f for f in diagnose(obs, simulate=False).findings if f.rule == "goodput_falls")
    assert "slo_admission deprioritize" in finding.change
    assert "missed the TTFT target" in finding.evidence[0]


def test_no_goodput_finding_without_targets_or_when_they_are_met():
    assert not [f for f in diagnose(long_chunks_window(), simulate=False).findings if f.rule == "goodput_falls"]
    met = long_chunks_window(tpot_slo_ms=100, ttft_slo_ms=500)
    assert count_misses(met, targets_of(met)).met == 40
    assert not [f for f in diagnose(met, simulate=False).findings if f.rule == "goodput_falls"]
