"""Each of doctor's rules on the situation it names, built on the fake runner (the real scheduler and KV manager);
and no finding on a healthy run."""

from __future__ import annotations

import pytest

from batchserve.doctor.observe import Finished, Observation, Step
from batchserve.doctor.rules import diagnose
from tests.doctor.load import Send, observe_closed_loop, observe_load, steady

WINDOW_S = 1.5


def rules_of(diagnosis) -> set[str]:
    return {f.rule for f in diagnosis.findings}


def test_a_healthy_run_has_no_finding():
    obs = observe_load(steady(25, WINDOW_S, 16, 8), WINDOW_S, max_batch_size=8, max_num_tokens=256)
    diagnosis = diagnose(obs)
    assert len(obs.requests) >= 20
    assert diagnosis.findings == [], [f.to_dict() for f in diagnosis.findings]


@pytest.fixture(scope="module")
def backed_up():
    """max_batch_size 2 against twice what two sequences can serve: the queue grows, the cap holds every step."""
    obs = observe_load(steady(100, WINDOW_S, 16, 8), WINDOW_S, max_batch_size=2, max_num_tokens=256)
    return obs, diagnose(obs)


def test_a_queue_held_by_max_batch_size(backed_up):
    obs, diagnosis = backed_up
    finding = next(f for f in diagnosis.findings if f.rule == "queue_backed_up")
    assert "max_batch_size 2 -> 4" in finding.change
    p = finding.prediction
    assert p is not None and p.change == {"max_batch_size": 4}
    assert p.after["output_tok_s"] > p.before["output_tok_s"] and p.after["ttft_p99_ms"] < p.before["ttft_p99_ms"]
    assert "predicted" in p.describe()


def test_arrivals_exceed_capacity(backed_up):
    obs, diagnosis = backed_up
    finding = next(f for f in diagnosis.findings if f.rule == "arrivals_exceed")
    assert obs.arrival_rate > 1.15 * obs.completion_rate
    replicas = finding.prediction.change["replicas"]
    assert replicas >= 2 and f"--replicas {replicas}" in finding.change
    assert finding.prediction.after["e2e_p99_ms"] < finding.prediction.before["e2e_p99_ms"]


@pytest.fixture(scope="module")
def kv_starved():
    """16 blocks of 16 tokens for up to 16 sequences of 20 + 30 tokens: the pool fills long before the budget."""
    sends = steady(150, WINDOW_S, 20, 30)
    obs = observe_load(sends, WINDOW_S, max_batch_size=16, max_num_tokens=256, num_kv_blocks=16, max_model_len=128)
    return obs, diagnose(obs)


def test_out_of_kv_memory(kv_starved):
    obs, diagnosis = kv_starved
    finding = next(f for f in diagnosis.findings if f.rule == "kv_full")
    assert obs.kv_usage_peak >= 0.95
    assert "block_size 16 -> 8" in finding.change or "num_kv_blocks 16 ->" in finding.change
    assert finding.prediction is not None


def test_preemption_thrash(kv_starved):
    obs, diagnosis = kv_starved
    finding = next(f for f in diagnosis.findings if f.rule == "preemption_thrash")
    assert obs.preemptions >= 5
    lower = finding.prediction.change["max_batch_size"]
    assert lower < 16 and f"max_batch_size 16 -> {lower}" in finding.change
    assert finding.prediction.after["preemptions"] < finding.prediction.before["preemptions"]


def test_long_prompts_hold_the_window():
    """One request in ten brings a 400-token prompt: its prefill takes the whole 32-token budget for 13 steps."""
    sends = [Send(i / 30, 400 if i % 10 == 5 else 8, 4) for i in range(int(30 * WINDOW_S))]
    obs = observe_load(sends, WINDOW_S, max_batch_size=16, max_num_tokens=32, max_model_len=512)
    finding = next(f for f in diagnose(obs).findings if f.rule == "long_prompts")
    assert "shortest_first" in finding.change and "max_input_len" in finding.change
    p = finding.prediction
    assert p.change == {"scheduling_order": "shortest_first"}
    assert p.after["ttft_p99_ms"] <= p.before["ttft_p99_ms"]


def test_an_idle_device_with_an_empty_queue_is_a_note_not_a_finding():
    """The seeds' other half of the first case: too few arrivals. Ten short steps in ten seconds, nobody waiting."""
    steps = [Step(0.01, 8, 0, 1, 0, 1, 2, 0) for _ in range(30)]
    requests = [Finished(8, 4, float(i), 0.01, 0.05) for i in range(10)]
    diagnosis = diagnose(Observation(10.0, {"max_batch_size": 8, "max_num_tokens": 256}, steps, requests))
    assert diagnosis.findings == []
    (note,) = diagnosis.notes
    assert "busy 3%" in note and "1.00 requests/s" in note
    assert diagnose(Observation(5.0, {})).notes == ["no traffic in the 5 s window: nothing to judge"]


def test_a_queue_growing_with_nothing_finished_still_exceeds_capacity():
    """A window too short for any request to finish (a slow device, long outputs): the queue's growth is enough."""
    steps = [Step(0.5, 0, 32, 32, i, 32, 100, 0) for i in range(40)]
    obs = Observation(20.0, {"max_batch_size": 32, "max_num_tokens": 2048, "num_kv_blocks": 1000}, steps,
                      in_flight_start=40, in_flight_end=100, waiting_start=8, waiting_end=68)  # fmt: skip
    finding = next(f for f in diagnose(obs).findings if f.rule == "arrivals_exceed")
    assert "3.00 requests/s arrived, none finished in 20 s" in finding.evidence[0]
    assert "--replicas 2" in finding.change and finding.prediction is None


def test_a_backlog_found_at_the_start_is_in_the_prediction():
    """16 clients in a closed loop against max_batch_size 2, queued before doctor looks: the predicted TTFT p99 (as
    configured, and with the suggested max_batch_size) is within 2x of what the server measures in each setting."""
    load = dict(clients=16, warmup_s=1.0, window_s=WINDOW_S, prompt_len=16, max_tokens=8, max_num_tokens=256)
    obs = observe_closed_loop(max_batch_size=2, **load)
    assert obs.waiting_start >= 8, "the window opens on a backlog"
    finding = next(f for f in diagnose(obs).findings if f.rule == "queue_backed_up")
    prediction = finding.prediction
    suggested = prediction.change["max_batch_size"]
    after = observe_closed_loop(max_batch_size=suggested, **load)
    for predicted, measured in ((prediction.before, obs), (prediction.after, after)):
        real_ms = 1000 * measured.latency("ttft_s", 0.99)
        assert real_ms / 2 <= predicted["ttft_p99_ms"] <= 2 * real_ms, (predicted["ttft_p99_ms"], real_ms)
