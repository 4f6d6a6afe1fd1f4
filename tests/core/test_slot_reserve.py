"""The slot reserve (slo_reserved_slots) on the fake runner: with the batch nearly full of requests that decode for
long, the last slots go to a request that cannot wait for a regular one (a tight TTFT target), not to an earlier
request whose loose target lets it wait; the held-back one gets a slot once its slack runs low, so it is not starved;
requests without targets and a batch with free regular slots are not affected."""

from __future__ import annotations

import pytest

from batchserve.config import ConfigError, SchedulerConfig
from batchserve.core.slo import FixedStepCost, SloUnattainableError
from tests.core.helpers import assert_all_blocks_free, drive, make_request, make_scheduler
from tests.fake_runner import FakeRunner

COST = FixedStepCost(fixed_s=0.05, per_token_s=0.001)  # a step of 4 decodes: 0.054 s


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _three_busy(reserved, mode="refuse"):
    """max_batch_size 4, three running requests with 100 tokens each to decode: one slot left."""
    clock = ManualClock()
    scheduler = make_scheduler(512, clock=clock, max_batch_size=4, slo_admission=mode, slo_reserved_slots=reserved)
    scheduler.slo.cost = COST
    runner = FakeRunner(512, 4)
    for i in range(3):
        scheduler.add_request(make_request(f"busy{i}", prompt_len=8, max_tokens=100))
    step(scheduler, runner, clock)
    return scheduler, runner, clock


def step(scheduler, runner, clock) -> set[str]:
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out))
    clock.now += 0.05
    return set(out.num_scheduled_tokens)


def test_the_last_slot_goes_to_the_tight_target_not_to_the_earlier_loose_one():
    scheduler, runner, clock = _three_busy(reserved=1)
    scheduler.add_request(make_request("summary", prompt_len=64, max_tokens=100, ttft_slo_ms=10_000))
    scheduler.add_request(make_request("question", prompt_len=8, ttft_slo_ms=500))
    assert "question" in step(scheduler, runner, clock)
    assert [r.request_id for r in scheduler.waiting] == ["summary"]  # ~5.4 s to a regular slot: it can wait


def test_without_the_reserve_the_earlier_request_takes_the_last_slot_and_the_tight_one_is_refused():
    scheduler, runner, clock = _three_busy(reserved=0)
    scheduler.add_request(make_request("summary", prompt_len=64, max_tokens=100, ttft_slo_ms=10_000))
    with pytest.raises(SloUnattainableError):  # it would wait ~5 s for a slot
        scheduler.add_request(make_request("question", prompt_len=8, ttft_slo_ms=500))
    assert "summary" in step(scheduler, runner, clock)


def test_a_held_back_request_takes_the_reserve_when_its_slack_runs_low():
    scheduler, runner, clock = _three_busy(reserved=1)
    scheduler.add_request(make_request("summary", prompt_len=64, max_tokens=100, ttft_slo_ms=10_000))
    assert "summary" not in step(scheduler, runner, clock)
    clock.now = 6.0  # 4 s of its target left: less than the ~5.3 s until a running request ends
    assert "summary" in step(scheduler, runner, clock)


def test_a_request_without_a_target_waits_for_a_regular_slot_and_everything_finishes():
    scheduler, runner, clock = _three_busy(reserved=1)
    scheduler.add_request(make_request("plain", prompt_len=8, max_tokens=4))
    assert "plain" not in step(scheduler, runner, clock)
    outputs = drive(scheduler, runner, {0: []}, on_step=lambda *_: None)
    assert len(outputs["plain"]) == 4
    assert_all_blocks_free(scheduler)


def test_the_default_reserve_is_a_quarter_of_the_batch_under_refuse_only():
    assert SchedulerConfig(max_batch_size=32, slo_admission="refuse").reserved_slots == 8
    assert SchedulerConfig(max_batch_size=32, slo_admission="deprioritize").reserved_slots == 0
    assert SchedulerConfig(max_batch_size=32).reserved_slots == 0
    assert SchedulerConfig(max_batch_size=32, slo_reserved_slots=3).reserved_slots == 3
    with pytest.raises(ConfigError, match="slo_reserved_slots"):
        SchedulerConfig(max_batch_size=4, slo_reserved_slots=4).validate()
    with pytest.raises(ConfigError, match="slo_reserved_slots"):
        SchedulerConfig(slo_reserved_slots=-1).validate()
