"""SLO-aware admission and preemption on the fake runner: a request predicted to miss its TTFT target or deadline
is refused before it takes a block (or demoted), a deadline that passes in the queue drops the request, preemption
takes the request with the most slack, and no request is preempted more than max_preemptions_per_request times."""

from __future__ import annotations

import pytest

from batchserve.core.slo import FixedStepCost, SloUnattainableError
from batchserve.request import FinishReason
from tests.core.helpers import assert_all_blocks_free, drive, make_request, make_scheduler
from tests.fake_runner import FakeRunner

COST = FixedStepCost(fixed_s=0.05, per_token_s=0.001)  # a 100-token step: 0.15 s


class ManualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _loaded(mode="refuse", **options):
    """Four 200-token prompts admitted and one step run: they hold blocks, three still prefill."""
    clock = ManualClock()
    scheduler = make_scheduler(512, clock=clock, slo_admission=mode, max_num_tokens=256, **options)
    scheduler.slo.cost = COST
    runner = FakeRunner(512, 4)
    for i in range(4):
        scheduler.add_request(make_request(f"busy{i}", prompt_len=200, max_tokens=8))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out))
    return scheduler, runner, clock


def test_a_request_that_cannot_meet_its_ttft_is_refused_before_it_takes_blocks():
    scheduler, _, _ = _loaded()
    free, waiting = scheduler.kv.pool.num_free_blocks, scheduler.num_waiting
    with pytest.raises(SloUnattainableError, match="TTFT target") as refused:
        scheduler.add_request(make_request("hopeless", prompt_len=50, ttft_slo_ms=100))
    assert refused.value.retry_after_s > 0
    assert scheduler.kv.pool.num_free_blocks == free and scheduler.num_waiting == waiting
    assert "hopeless" not in scheduler.requests and scheduler.slo.num_refused == 1
    scheduler.add_request(make_request("patient", prompt_len=50, ttft_slo_ms=60_000))  # the same load, a loose target
    assert "patient" in scheduler.requests


def test_a_deadline_that_cannot_be_met_is_refused_even_without_slo_admission():
    scheduler, _, clock = _loaded(mode="off")
    late = make_request("late", prompt_len=50)
    late.deadline = clock.now + 0.05
    with pytest.raises(SloUnattainableError):
        scheduler.add_request(late)
    gone = make_request("gone", prompt_len=50)
    gone.deadline = clock.now
    with pytest.raises(SloUnattainableError, match="passed"):
        scheduler.add_request(gone)
    on_time = make_request("ok", prompt_len=50, ttft_slo_ms=1)  # a target alone is not acted on when off
    on_time.deadline = clock.now + 60
    scheduler.add_request(on_time)


def test_a_deadline_passing_in_the_queue_drops_the_request_before_it_takes_blocks():
    clock = ManualClock()
    scheduler = make_scheduler(64, clock=clock, max_batch_size=1)  # no step-time fit: nothing is predicted
    runner = FakeRunner(64, 4)
    scheduler.add_request(make_request("running", prompt_len=8, max_tokens=50))
    waiting = make_request("waiting", prompt_len=8)
    waiting.deadline = 1.0
    scheduler.add_request(waiting)
    ended = []
    for _ in range(3):
        clock.now += 0.6
        out = scheduler.schedule()
        ended += [o for o in scheduler.update_from_output(out, runner.execute(out)) if o.finished]
    assert [(o.request_id, o.finish_reason, o.stop_reason) for o in ended] == [
        ("waiting", FinishReason.ABORT, "deadline")
    ]
    assert waiting.first_scheduled_time is None and scheduler.kv.num_blocks_of(waiting) == 0


def test_a_waiting_request_that_becomes_hopeless_is_dropped_under_refuse():
    clock = ManualClock()
    scheduler = make_scheduler(64, clock=clock, max_batch_size=1, slo_admission="refuse")
    scheduler.slo.cost = COST
    runner = FakeRunner(64, 4)
    scheduler.add_request(make_request("running", prompt_len=8, max_tokens=4))
    out = scheduler.schedule()
    scheduler.update_from_output(out, runner.execute(out))
    hopeful = make_request("hopeful", prompt_len=8, ttft_slo_ms=2000)  # its slot frees in 3 steps: ~0.15 s
    scheduler.add_request(hopeful)
    clock.now += 1.9  # the running request stalls (the host is busy): 0.1 s left, less than the wait
    out = scheduler.schedule()
    finished = [o for o in scheduler.update_from_output(out, runner.execute(out)) if o.finished]
    assert [(o.request_id, o.stop_reason) for o in finished] == [("hopeful", "slo_unattainable")]
    assert hopeful.first_scheduled_time is None


def test_deprioritize_serves_a_hopeless_request_after_the_others():
    clock = ManualClock()
    scheduler = make_scheduler(256, clock=clock, max_batch_size=1, slo_admission="deprioritize")
    scheduler.slo.cost = COST
    runner = FakeRunner(256, 4)
    requests = [make_request("first", max_tokens=6), make_request("hopeless", ttft_slo_ms=10),
                make_request("next", ttft_slo_ms=60_000)]  # fmt: skip
    order = []

    def on_step(sched, out):
        clock.now += 0.05
        order.extend(rid for rid in out.num_scheduled_tokens if rid not in order)

    outputs = drive(scheduler, runner, {0: requests}, on_step=on_step)
    assert order == ["first", "next", "hopeless"]
    assert len(outputs["hopeless"]) == 4 and scheduler.slo.num_demoted == 1  # demoted, still served


@pytest.mark.parametrize("mode, preempted", [("off", "tight"), ("refuse", "loose")])
def test_preemption_takes_the_request_with_the_most_slack(mode, preempted):
    """`loose` has no target (unbounded slack) and ranks first; `tight` has a TPOT target and ranks last. Out of
    blocks, the rank alone preempts `tight`; by slack `loose` gives way."""
    scheduler = make_scheduler(8, clock=ManualClock(), slo_admission=mode)
    scheduler.slo.cost = COST
    loose, tight = make_request("loose", max_tokens=20), make_request("tight", max_tokens=20, tpot_slo_ms=1000)
    drive(scheduler, FakeRunner(8, 4), {0: [loose, tight]})
    counts = {"loose": loose.num_preemptions, "tight": tight.num_preemptions}
    assert counts[preempted] >= 1 and counts[({"loose", "tight"} - {preempted}).pop()] == 0
    assert_all_blocks_free(scheduler)


def _thrash(k):
    scheduler = make_scheduler(24, max_batch_size=8, max_num_tokens=64, max_preemptions_per_request=k)
    requests = [make_request(f"r{i}", prompt_len=8, max_tokens=60) for i in range(20)]
    outputs = drive(scheduler, FakeRunner(24, 4), {i: [r] for i, r in enumerate(requests)})
    assert all(len(outputs[r.request_id]) == 60 for r in requests)
    assert_all_blocks_free(scheduler)
    return max(r.num_preemptions for r in requests), scheduler.num_forced_preemptions


@pytest.mark.parametrize("k", [1, 2, 3])
def test_no_request_is_preempted_more_than_k_times(k):
    most, forced = _thrash(k)
    assert most <= k and forced == 0


def test_without_the_guard_the_same_load_thrashes():
    most, _ = _thrash(None)
    assert most > 3


def test_a_short_prompt_is_predicted_to_overtake_waiting_long_ones():
    from batchserve.config import SchedulerConfig
    from batchserve.core.slo import LoadSnapshot, SloPlanner

    config = SchedulerConfig(max_num_tokens=1024, long_prefill_token_threshold=128, max_long_partial_prefills=1)
    planner = SloPlanner(config, FixedStepCost(fixed_s=0.05, per_token_s=0.001))
    load = planner.snapshot([])
    for i in range(2):
        planner.account(make_request(f"long{i}", prompt_len=2000), load)
    short, long = make_request("short", prompt_len=50), make_request("long", prompt_len=2000)
    # one step: its own 50 tokens beside one 128-token chunk of the long prompts ahead
    assert planner.predicted_wait_s(short, load) == pytest.approx(0.05 + 0.001 * 128 + 0.001 * 50)
    # a long prompt waits for all 6,000 tokens, its own 2,000 at 128 a step: 16 steps
    assert planner.predicted_wait_s(long, load) == pytest.approx(16 * 0.05 + 0.001 * 6000)
    assert planner.predicted_wait_s(short, LoadSnapshot(0, 0, 0, [], 0)) == pytest.approx(0.05 + 0.001 * 50)
