import random

import pytest

from batchserve.request import FinishReason, RequestStatus
from tests.core.helpers import assert_all_blocks_free, drive, make_request, make_scheduler
from tests.fake_runner import FakeRunner, reference_generation


def run_and_check(scheduler, arrivals, runner=None):
    runner = runner or FakeRunner(
        scheduler.kv.pool.num_blocks, scheduler.kv.block_size, num_swap_blocks=scheduler.kv.host_pool.num_blocks
    )
    requests = [r for batch in arrivals.values() for r in batch]
    outputs = drive(scheduler, runner, arrivals)
    for r in requests:
        assert outputs[r.request_id] == reference_generation(r.prompt_token_ids, r.sampling_params.max_tokens), r
    assert_all_blocks_free(scheduler)
    return runner


# ---- the seeds' worked examples -------------------------------------------------------------------------------
def test_seed_4_2_window_admits_17_new_requests():
    """Section 4.2: a window of 8192 tokens holding 32 sequences of 200 tokens leaves 1792, room for 17 requests
    of 100 tokens. Modelled quantity: tokens computed in one forward pass (max_num_tokens), with the 32 sequences
    computing their 200 tokens in this pass and chunked prefill off so a request is admitted only whole."""
    s = make_scheduler(
        num_blocks=4096, block_size=16, max_num_tokens=8192, max_batch_size=64, enable_chunked_prefill=False
    )
    for i in range(32):
        s.add_request(make_request(f"run{i}", prompt_len=200))
    for i in range(20):
        s.add_request(make_request(f"new{i}", prompt_len=100))
    out = s.schedule()
    new = [rid for rid in out.num_scheduled_tokens if rid.startswith("new")]
    assert out.total_num_scheduled_tokens == 6400 + 1700
    assert len(new) == 17 and s.num_waiting == 3
    assert 8192 - out.total_num_scheduled_tokens == 92  # left over, too small for an 18th whole prompt


def test_seed_4_2_with_chunked_prefill_the_18th_gets_a_chunk():
    s = make_scheduler(num_blocks=4096, block_size=16, max_num_tokens=8192, max_batch_size=64)
    for i in range(32):
        s.add_request(make_request(f"run{i}", prompt_len=200))
    for i in range(20):
        s.add_request(make_request(f"new{i}", prompt_len=100))
    out = s.schedule()
    assert out.total_num_scheduled_tokens == 8192
    assert out.num_scheduled_tokens["new17"] == 92 and "new18" not in out.num_scheduled_tokens


@pytest.mark.parametrize("num_short", [20, 30])
def test_seed_4_4_long_request_fits_beside_short_ones(num_short):
    """Section 4.4: short Q&A of 150 tokens and one 2500-token summary. Modelled quantity: tokens of one forward
    pass, with every request computing its whole prompt in it (3000 or 4500 + 2500 <= 8192)."""
    s = make_scheduler(num_blocks=4096, block_size=16, max_num_tokens=8192, max_batch_size=32)
    for i in range(num_short):
        s.add_request(make_request(f"short{i}", prompt_len=150))
    s.add_request(make_request("long", prompt_len=2500))
    out = s.schedule()
    assert out.num_scheduled_tokens["long"] == 2500
    assert out.total_num_scheduled_tokens == 150 * num_short + 2500


def test_seed_4_4_full_batch_makes_long_request_wait_despite_free_tokens():
    s = make_scheduler(num_blocks=4096, block_size=16, max_num_tokens=8192, max_batch_size=32)
    runner = FakeRunner(4096, 16)
    shorts = [make_request(f"short{i}", prompt_len=150, max_tokens=3 if i == 0 else 50) for i in range(32)]
    for r in shorts:
        s.add_request(r)
    first = s.schedule()
    s.update_from_output(first, runner.execute(first))
    s.add_request(make_request("long", prompt_len=2500))
    out = s.schedule()
    assert "long" not in out.num_scheduled_tokens and out.total_num_scheduled_tokens == 32  # 8160 tokens unused
    for _ in range(200):
        if "long" in out.num_scheduled_tokens:
            break
        s.update_from_output(out, runner.execute(out))
        out = s.schedule()
    else:
        raise AssertionError("the long prompt was never scheduled")
    assert shorts[0].is_finished and s.running[-1].request_id == "long"


# ---- continuous batching ---------------------------------------------------------------------------------------
def test_chunked_prefill_splits_a_long_prompt_and_keeps_decodes_running():
    s = make_scheduler(num_blocks=256, block_size=4, max_num_tokens=16, max_batch_size=8)
    runner = FakeRunner(256, 4)
    short = make_request("short", prompt_len=4, max_tokens=20)
    long = make_request("long", prompt_len=50, max_tokens=3)
    chunks = []

    def record(scheduler, scheduled):
        chunks.append(dict(scheduled.num_scheduled_tokens))

    outputs = drive(s, runner, {0: [short], 2: [long]}, on_step=record)
    long_chunks = [c["long"] for c in chunks if "long" in c]
    assert long_chunks[:4] == [15, 15, 15, 5]  # one token of each step's budget stays with the decode
    assert all("short" in c for c in chunks[:6])  # the decode never stalls behind the long prompt
    assert all(sum(c.values()) <= 16 for c in chunks)
    assert outputs["long"] == reference_generation(long.prompt_token_ids, 3)
    assert_all_blocks_free(s)


def test_sequences_enter_and_leave_at_any_iteration():
    s = make_scheduler(num_blocks=256, block_size=4, max_num_tokens=64, max_batch_size=3)
    requests = {i: [make_request(f"r{i}", prompt_len=3 + i, max_tokens=2 + (i * 3) % 7)] for i in range(10)}
    batches = []
    runner = run_and_check(s, requests)
    for out in runner.steps:
        batches.append(set(out.num_scheduled_tokens))
        assert len(out.num_scheduled_tokens) <= 3
    # a finished request's slot is refilled in the very next step
    assert any(len(b) == 3 and len(b - prev) >= 1 and len(prev - b) >= 1 for prev, b in zip(batches, batches[1:]))


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict", "static"])
@pytest.mark.parametrize("order", ["fcfs", "priority", "shortest_first"])
@pytest.mark.parametrize("caching", [True, False])
def test_outputs_identical_under_every_policy_and_order(policy, order, caching):
    rng = random.Random(7)
    prefix = [rng.randrange(1, 900) for _ in range(12)]
    arrivals = {}
    for i in range(24):
        prompt = (prefix if i % 2 else []) + [rng.randrange(1, 900) for _ in range(rng.randrange(1, 30))]
        arrivals.setdefault(rng.randrange(0, 20), []).append(
            make_request(
                f"r{i}", prompt=prompt, max_tokens=rng.randrange(1, 12), priority=rng.randrange(3), arrival=float(i)
            )
        )
    s = make_scheduler(
        num_blocks=40,
        block_size=4,
        caching=caching,
        max_num_tokens=24,
        max_batch_size=6,
        scheduler_policy=policy,
        scheduling_order=order,
    )
    run_and_check(s, arrivals)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_tiny_pool_preempts_many_times_and_outputs_stay_identical(mode):
    rng = random.Random(3)
    arrivals = {
        0: [make_request(f"r{i}", prompt_len=rng.randrange(4, 20), max_tokens=rng.randrange(8, 30)) for i in range(12)]
    }
    s = make_scheduler(
        num_blocks=14, block_size=4, host_blocks=64, max_num_tokens=32, max_batch_size=8, preemption_mode=mode
    )
    run_and_check(s, arrivals)
    assert s.num_preemptions_total >= 5
    if mode == "swap":
        runner_swaps = s.num_preemptions_total
        assert runner_swaps > 0


def test_swap_mode_actually_swaps():
    arrivals = {0: [make_request(f"r{i}", prompt_len=10, max_tokens=20) for i in range(6)]}
    s = make_scheduler(
        num_blocks=14, block_size=4, host_blocks=64, max_num_tokens=32, max_batch_size=8, preemption_mode="swap"
    )
    runner = run_and_check(s, arrivals)
    assert any(o.blocks_to_swap_out for o in runner.steps) and any(o.blocks_to_swap_in for o in runner.steps)


def test_guaranteed_no_evict_never_preempts_on_random_workloads():
    for seed in range(5):
        rng = random.Random(seed)
        arrivals = {}
        for i in range(30):
            arrivals.setdefault(rng.randrange(0, 40), []).append(
                make_request(f"r{i}", prompt_len=rng.randrange(1, 25), max_tokens=rng.randrange(1, 25))
            )
        s = make_scheduler(
            num_blocks=30, block_size=4, max_num_tokens=32, max_batch_size=8, scheduler_policy="guaranteed_no_evict"
        )
        run_and_check(s, arrivals)
        assert s.num_preemptions_total == 0


def test_static_never_admits_into_a_running_batch():
    arrivals = {i: [make_request(f"r{i}", prompt_len=5, max_tokens=1 + (i * 5) % 9)] for i in range(12)}
    s = make_scheduler(num_blocks=64, block_size=4, max_num_tokens=64, max_batch_size=4, scheduler_policy="static")
    members: set[str] = set()

    def check(scheduler, scheduled):
        nonlocal members
        running = {r.request_id for r in scheduler.running}
        joined = set(scheduled.num_scheduled_tokens) - members
        if joined:
            assert not (members & running), "a request joined while the previous batch was still running"
            members = set(scheduled.num_scheduled_tokens) | running
        assert len(scheduled.num_scheduled_tokens) <= 4

    runner = FakeRunner(64, 4)
    outputs = drive(s, runner, arrivals, on_step=check)
    assert all(len(outputs[f"r{i}"]) == 1 + (i * 5) % 9 for i in range(12))
    assert_all_blocks_free(s)


@pytest.mark.parametrize("padding", [True, False])
def test_static_padding_keeps_finished_members_computed_until_the_batch_is_done(padding):
    lengths = [2, 5, 9]
    arrivals = {0: [make_request(f"r{i}", prompt_len=6, max_tokens=n) for i, n in enumerate(lengths)]}
    s = make_scheduler(
        num_blocks=64,
        block_size=4,
        max_num_tokens=64,
        max_batch_size=4,
        scheduler_policy="static",
        static_padding=padding,
    )
    seen = []

    def check(scheduler, scheduled):
        seen.append((set(scheduled.num_scheduled_tokens), set(scheduled.padding_req_ids), scheduler.stats()))

    outputs = drive(s, FakeRunner(64, 4), arrivals, on_step=check)
    assert all(
        outputs[f"r{i}"] == reference_generation(make_request(f"r{i}", prompt_len=6, max_tokens=n).prompt_token_ids, n)
        for i, n in enumerate(lengths)
    )
    # steps 0..8: step k samples every member's (k+1)-th token; r0 is done after step 1, r1 after step 4
    for step, (scheduled, pad, stats) in enumerate(seen[:9]):
        finished = {f"r{i}" for i, n in enumerate(lengths) if n <= step}
        assert pad == (finished if padding else set())
        assert scheduled == {"r0", "r1", "r2"} if padding else scheduled == {"r0", "r1", "r2"} - finished
        assert stats.num_scheduled_seqs == 3 - len(finished)  # padding is not useful work
        if padding and step < 8:  # a padded member holds its blocks while the batch runs (until r2 is done)
            assert stats.kv_blocks_used >= 3 * 2
    assert_all_blocks_free(s)


def test_static_padding_stays_within_the_token_budget():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_tokens=16, max_batch_size=4, scheduler_policy="static")
    runner = FakeRunner(64, 4)
    totals = []
    drive(
        s,
        runner,
        {0: [make_request("a", prompt_len=2, max_tokens=1), make_request("b", prompt_len=40, max_tokens=3)]},
        on_step=lambda sched, out: totals.append((out.total_num_scheduled_tokens, set(out.padding_req_ids))),
    )
    assert max(total for total, _ in totals) == 16
    assert totals[1] == (16, set())  # b's next chunk takes the whole budget: no room for a's padding
    assert any(pad == {"a"} for _, pad in totals[2:])  # padding resumes once b decodes


def test_static_padding_is_released_when_the_last_member_finishes():
    s = make_scheduler(num_blocks=16, block_size=4, max_num_tokens=64, max_batch_size=2, scheduler_policy="static")
    runner = FakeRunner(16, 4)
    outputs = drive(
        s,
        runner,
        {
            0: [make_request("a", prompt_len=3, max_tokens=1), make_request("b", prompt_len=3, max_tokens=4)],
            1: [make_request("c", prompt_len=3, max_tokens=2)],
        },
    )
    assert [len(outputs[r]) for r in "abc"] == [1, 4, 2]
    # c is admitted only after b, and a's padding is gone from that step on
    first_c = next(i for i, out in enumerate(runner.steps) if "c" in out.num_scheduled_tokens)
    assert "a" in runner.steps[first_c].finished_req_ids
    assert all("a" not in out.num_scheduled_tokens for out in runner.steps[first_c:])
    assert_all_blocks_free(s)


def test_an_id_is_not_reused_while_it_is_padding():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_tokens=64, max_batch_size=2, scheduler_policy="static")
    runner = FakeRunner(64, 4)
    for r in (make_request("a", prompt_len=3, max_tokens=1), make_request("b", prompt_len=3, max_tokens=5)):
        s.add_request(r)
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))  # a is done, now padding
    assert not s.is_id_free("a") and s.is_id_free("c")
    with pytest.raises(ValueError, match="duplicate"):
        s.add_request(make_request("a", prompt_len=3, max_tokens=1))
    drive(s, runner, {})
    assert s.is_id_free("a")
    assert_all_blocks_free(s)


def test_priority_arrival_preempts_lowest_running():
    s = make_scheduler(num_blocks=64, block_size=4, max_num_tokens=64, max_batch_size=2, scheduling_order="priority")
    runner = FakeRunner(64, 4)
    low = [make_request(f"low{i}", prompt_len=4, max_tokens=30, priority=5, arrival=i) for i in range(2)]
    urgent = make_request("urgent", prompt_len=4, max_tokens=2, priority=0, arrival=10)
    outputs = drive(s, runner, {0: low, 3: [urgent]})
    assert low[1].num_preemptions == 1 and low[0].num_preemptions == 0
    assert urgent.finished_time < low[0].finished_time
    assert outputs["low1"] == reference_generation(low[1].prompt_token_ids, 30)


def test_priority_preemption_admits_the_urgent_request_in_the_same_step():
    # The pool is too full for the urgent request, so the running one is preempted for it: that very step runs the
    # urgent request (found by the state machine: the step used to run nothing while both waited).
    s = make_scheduler(num_blocks=13, block_size=4, max_num_tokens=16, max_batch_size=4, scheduling_order="priority")
    runner = FakeRunner(13, 4)
    long = make_request("long", prompt_len=49, max_tokens=1, priority=1, arrival=0)
    urgent = make_request("urgent", prompt_len=5, max_tokens=1, priority=0, arrival=1)
    steps = []

    def record(scheduler, scheduled):
        steps.append((long.num_preemptions, dict(scheduled.num_scheduled_tokens)))

    # chunks of 16: after three steps `long` holds 48 of its 49 prompt tokens in 12 of the 13 blocks
    outputs = drive(s, runner, {0: [long], 1: [urgent]}, on_step=record)
    assert steps[:3] == [(0, {"long": 16})] * 3
    assert steps[3][0] == 1 and "urgent" in steps[3][1]
    assert outputs["urgent"] == reference_generation(urgent.prompt_token_ids, 1)
    assert outputs["long"] == reference_generation(long.prompt_token_ids, 1)
    assert_all_blocks_free(s)


def test_shortest_first_with_aging():
    now = [0.0]
    s = make_scheduler(
        num_blocks=64,
        block_size=4,
        max_num_tokens=64,
        max_batch_size=1,
        scheduling_order="shortest_first",
        max_wait_s=5.0,
        clock=lambda: now[0],
    )
    long = make_request("long", prompt_len=20, max_tokens=10, arrival=0.0)
    s.add_request(long)
    s.add_request(make_request("short", prompt_len=2, max_tokens=2, arrival=1.0))
    assert s.waiting.peek().request_id == "short"
    now[0] = 6.0  # the long one has waited past max_wait_s
    assert s.waiting.peek().request_id == "long"


def test_abort_frees_blocks_and_reports():
    s = make_scheduler(num_blocks=32, block_size=4)
    runner = FakeRunner(32, 4)
    a, b = make_request("a", max_tokens=50), make_request("b", max_tokens=50)
    s.add_request(a)
    s.add_request(b)
    out = s.schedule()
    s.update_from_output(out, runner.execute(out))
    finished = s.abort_requests(["a", "b", "unknown"])
    assert [o.finish_reason for o in finished] == [FinishReason.ABORT] * 2
    assert a.status == RequestStatus.FINISHED
    assert_all_blocks_free(s)
    out = s.schedule()
    assert out.finished_req_ids == {"a", "b"} and out.is_empty


def test_stop_token_and_max_model_len():
    s = make_scheduler(num_blocks=32, block_size=4, max_model_len=12)
    runner = FakeRunner(32, 4)
    first = reference_generation(list(range(1, 9)), 1)[0]
    stopper = make_request("stop", prompt=list(range(1, 9)), max_tokens=10, stop_token_ids=[first])
    capped = make_request("cap", prompt=list(range(2, 10)), max_tokens=10)
    drive(s, runner, {0: [stopper, capped]})
    assert stopper.finish_reason == FinishReason.STOP and stopper.stop_reason == first
    assert capped.finish_reason == FinishReason.LENGTH and capped.num_tokens == 12


def test_shared_system_prompt_saves_blocks_and_prefill():
    """32 requests share a 1,000-token system prompt. With prefix caching, KV blocks in use drop by at
    least 30% and the prompt tokens computed drop accordingly."""
    rng = random.Random(0)
    system = [rng.randrange(1, 900) for _ in range(1000)]

    def run(caching):
        s = make_scheduler(num_blocks=4000, block_size=16, caching=caching, max_num_tokens=2048, max_batch_size=32)
        reqs = [
            make_request(f"r{i}", prompt=system + [rng.randrange(1, 900) for _ in range(40)], max_tokens=8)
            for i in range(32)
        ]
        peak, prefill = [0], [0]

        def watch(scheduler, scheduled):
            peak[0] = max(peak[0], scheduler.kv.pool.num_used_blocks)
            prefill[0] += scheduler.stats().num_prefill_tokens

        drive(s, FakeRunner(4000, 16), {0: reqs}, on_step=watch)
        assert_all_blocks_free(s)
        return peak[0], prefill[0], s.stats().prefix_cache_hit_rate

    peak_off, prefill_off, _ = run(False)
    peak_on, prefill_on, hit_rate = run(True)
    assert peak_on <= 0.7 * peak_off
    assert prefill_on <= 0.3 * prefill_off
    assert hit_rate > 0.8
