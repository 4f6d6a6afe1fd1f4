"""The scheduler with LoRA adapters, model-free: never more than max_loras adapters in one step, a waiting adapter
is not starved by a steady stream of requests for the running ones, and prefix-cache keys differ per adapter."""

from __future__ import annotations

import pytest

from batchserve.core.lora_schedule import AdapterGate, first_parent
from tests.core.helpers import assert_all_blocks_free, drive, make_request, make_scheduler
from tests.fake_runner import FakeRunner

LORA_OF: dict[str, int] = {}  # request id -> adapter, kept after the scheduler forgets a finished request


def lora_request(rid, lora_id, arrival=0.0, **kwargs):
    request = make_request(rid, arrival=arrival, **kwargs)
    request.lora_id = LORA_OF[rid] = lora_id
    return request


def adapters_of(scheduled):
    return {LORA_OF[r] for r in scheduled.num_scheduled_tokens} - {0}


def runner_for(scheduler):
    return FakeRunner(scheduler.kv.pool.num_blocks, scheduler.kv.block_size)


@pytest.mark.parametrize(
    "pool",
    [dict(num_blocks=256), dict(num_blocks=16), dict(num_blocks=16, host_blocks=64, preemption_mode="swap")],
    ids=["roomy", "preempting", "swapping"],
)
def test_no_step_carries_more_than_max_loras_adapters(pool):
    """Whatever joins the running set (admitted, readmitted after a preemption, swapped in)."""
    scheduler = make_scheduler(max_batch_size=16, **pool)
    scheduler.adapters = AdapterGate(2)
    arrivals = {0: [lora_request(f"r{i}", i % 5, max_tokens=8 + i % 8) for i in range(30)]}
    seen = []

    def check(s, scheduled):
        adapters = adapters_of(scheduled)
        assert len(adapters) <= 2, adapters
        seen.append(adapters)

    runner = FakeRunner(scheduler.kv.pool.num_blocks, 4, num_swap_blocks=pool.get("host_blocks", 0))
    outputs = drive(scheduler, runner, arrivals, on_step=check)
    assert len(outputs) == 30
    assert set().union(*seen) == {1, 2, 3, 4}  # every adapter ran, two at most at a time
    assert (scheduler.num_preemptions_total > 0) == (pool["num_blocks"] < 256)
    assert_all_blocks_free(scheduler)


def test_base_model_requests_are_never_held_back_by_the_limit():
    scheduler = make_scheduler(num_blocks=256, max_batch_size=16)
    scheduler.adapters = AdapterGate(1)
    for i, lora_id in enumerate([1, 2, 0, 0]):
        scheduler.add_request(lora_request(f"r{i}", lora_id, max_tokens=8))
    scheduled = scheduler.schedule()
    assert set(scheduled.num_scheduled_tokens) == {"r0", "r2", "r3"}  # adapter 2 waits, the base ones pass it


def test_a_waiting_adapter_gets_its_place_under_a_steady_stream():
    """Requests of adapter 1 keep arriving; one of adapter 2 waits. Past the patience, adapter 1's later requests
    stop joining, its running ones finish, and adapter 2 runs: it is not starved."""
    now = [0.0]
    scheduler = make_scheduler(num_blocks=512, max_batch_size=8, clock=lambda: now[0])
    scheduler.adapters = AdapterGate(1, patience_s=5.0)
    runner = runner_for(scheduler)
    scheduler.add_request(lora_request("first", 1, max_tokens=6))
    scheduler.add_request(lora_request("other", 2, arrival=0.0, max_tokens=2))
    started = None
    for step in range(200):
        now[0] = float(step)
        scheduler.add_request(lora_request(f"s{step}", 1, arrival=now[0], max_tokens=6))  # the stream never stops
        scheduled = scheduler.schedule()
        assert len(adapters_of(scheduled)) <= 1
        if "other" in scheduled.num_scheduled_tokens:
            started = step
            break
        scheduler.update_from_output(scheduled, runner.execute(scheduled))
    assert started is not None, "adapter 2 never ran"
    assert started <= 5 + 6 + 2  # patience, then the longest running request of adapter 1 drains


def test_prefix_cache_keys_differ_per_adapter():
    base, a, b = (lora_request(f"r{i}", lora, prompt=list(range(1, 17))) for i, lora in enumerate([0, 1, 2]))
    assert len({first_parent(r) for r in (base, a, b)}) == 3
    assert first_parent(base) is None


def test_two_adapters_never_share_blocks_of_the_same_prompt():
    scheduler = make_scheduler(num_blocks=64, block_size=4)
    scheduler.adapters = AdapterGate(2)
    prompt = list(range(1, 18))
    drive(scheduler, runner_for(scheduler), {0: [lora_request("a1", 1, prompt=prompt)]})
    second = {0: [lora_request("b1", 2, prompt=prompt), lora_request("a2", 1, prompt=prompt)]}
    drive(scheduler, runner_for(scheduler), second)
    cached = {r: scheduler.requests.get(r) for r in ("b1", "a2")}
    assert all(v is None for v in cached.values())  # finished and forgotten
    hits = scheduler.kv.prefix_hits
    assert hits == 16  # a2 found a1's four full blocks; b1 found none
