import pytest

from batchserve.bench.arrivals import ArrivalProcess
from batchserve.bench.metrics import summarize
from batchserve.bench.offline import BusyClock, OfflineRun, run_lockstep, run_offline
from batchserve.bench.workloads import WorkloadOptions, make_workload


def test_offline_records_every_request_and_step(make_engine):
    engine = make_engine(max_batch_size=4)
    reqs = make_workload("uniform", engine.tokenizer, 10, options=WorkloadOptions(input_len=8, output_len=6))
    trace = run_offline(engine, reqs, progress=False)
    assert [r.request_id for r in trace.requests] == [r.request_id for r in reqs]
    for r, q in zip(trace.requests, reqs, strict=False):
        assert r.success and r.output_len == q.output_len and r.prompt_len == 8
        assert len(r.token_times) == q.output_len
        assert r.arrival_time <= r.first_token_time <= r.finish_time
    assert trace.max_batch_size == 4
    assert all(s.num_scheduled_seqs <= 4 for s in trace.steps)
    assert sum(len(s.finished) for s in trace.steps) == 10
    assert sum(1 for s in trace.steps for _, p in s.scheduled.values() if p) == 10  # one prefill each


def test_static_wastes_slots_that_dynamic_refills(make_engine):
    """The real scheduler's static policy against continuous batching on one saturated workload: 64 requests of
    100 +- 20% output tokens through 8 slots. A static batch runs until its longest member is done, so its finished
    members' slots idle (about 100/117 of the slots do work); continuous batching refills a slot the step after it
    frees. Fails if core/scheduler.py's static policy stops wasting slots (or max_utilization stops refilling them)."""
    summaries = {}
    for policy in ("static", "max_utilization"):
        engine = make_engine(max_batch_size=8, scheduler_policy=policy)
        reqs = make_workload("uniform", engine.tokenizer, 64, seed=1, options=WorkloadOptions(input_len=8))
        trace = run_offline(engine, reqs, progress=False)
        assert all(r.success and r.output_len == q.output_len for r, q in zip(trace.requests, reqs, strict=True))
        summary = summarize(trace.requests, trace.meta["duration_s"], steps=trace.steps)
        summaries[policy] = {k: summary[k] for k in ("batch_occupancy_saturated", "batch_occupancy", "num_steps")}
        # steps where a newcomer's prefill ran beside decodes of a batch already running: joins mid-batch
        summaries[policy]["join_steps"] = sum(
            1 for st in trace.steps if len({prefill for _, prefill in st.scheduled.values()}) == 2
        )
    s, d = summaries["static"], summaries["max_utilization"]
    # measured: static 0.876 saturated occupancy in 915 steps, max_utilization 1.0 in 836 (deterministic: the fake
    # runner and a seeded workload); a static policy that admits like max_utilization reaches 0.929 in 902
    assert 0.75 < s["batch_occupancy_saturated"] < 0.90, summaries  # +-20% lengths: ~100/117 of the slots do work
    assert d["batch_occupancy_saturated"] == pytest.approx(1.0), summaries
    assert s["batch_occupancy_saturated"] < d["batch_occupancy_saturated"] - 0.05, summaries
    assert s["num_steps"] > 1.05 * d["num_steps"], summaries
    assert s["join_steps"] == 0 and d["join_steps"] > 0, summaries


def test_arrivals_and_concurrency_cap(make_engine):
    engine = make_engine(max_batch_size=16)
    reqs = make_workload("uniform", engine.tokenizer, 12, options=WorkloadOptions(input_len=4, output_len=3, spread=0))
    trace = run_offline(engine, reqs, ArrivalProcess(max_concurrency=2), progress=False)
    assert max(s.num_running for s in trace.steps) <= 2
    engine = make_engine(max_batch_size=16)
    trace = run_offline(engine, reqs, ArrivalProcess(request_rate=200.0), seed=0, progress=False)
    arrivals = [r.arrival_time - trace.t0 for r in trace.requests]
    assert arrivals == sorted(arrivals) and arrivals[-1] > 0.01
    assert trace.meta["duration_s"] >= arrivals[-1]


def test_failed_add_is_recorded(make_engine):
    engine = make_engine(max_batch_size=4)

    def refuse(*args, **kwargs):
        raise ValueError("queue full")

    engine.add_request = refuse
    reqs = make_workload("uniform", engine.tokenizer, 3, options=WorkloadOptions(input_len=4, output_len=2))
    trace = run_offline(engine, reqs, progress=False)
    assert [r.success for r in trace.requests] == [False] * 3
    assert "queue full" in trace.requests[0].error


def test_busy_clock_counts_only_busy_time_and_virtual_sleep():
    real = [0.0]
    clock = BusyClock(lambda: real[0])
    real[0] = 5.0  # idle: not counted
    with clock.busy():
        real[0] = 7.0
        assert clock() == pytest.approx(2.0)
    real[0] = 100.0
    clock.sleep(0.5)  # a run idling until its next arrival: counted, without waiting
    assert clock() == pytest.approx(2.5)


def test_lockstep_runs_time_only_their_own_steps(make_engine, tokenizer):
    # Two engines stepped alternately: a slow one (20 ms steps) and a fast one (2 ms steps). Each run's duration
    # holds its own steps only, not the other's.
    reqs = make_workload("uniform", tokenizer, 6, options=WorkloadOptions(input_len=4, output_len=5, spread=0))
    slow = make_engine(max_batch_size=8, delay_s=0.02)
    fast = make_engine(max_batch_size=8, delay_s=0.002)
    runs = [
        OfflineRun(e, reqs, label=n, progress=False, clock=BusyClock()) for n, e in (("slow", slow), ("fast", fast))
    ]
    slow_trace, fast_trace = run_lockstep(runs)
    n_slow, n_fast = len(slow_trace.steps), len(fast_trace.steps)
    assert n_slow == n_fast == 5
    assert 0.02 * n_slow <= slow_trace.meta["duration_s"] < 0.02 * n_slow + 0.05
    assert 0.002 * n_fast <= fast_trace.meta["duration_s"] < 0.02 * n_fast  # the slow engine's steps not counted
    for trace in (slow_trace, fast_trace):
        assert all(r.success and r.output_len == 5 for r in trace.requests)
        assert all(
            r.arrival_time <= r.first_token_time <= r.finish_time <= trace.meta["duration_s"] for r in trace.requests
        )
    with pytest.raises(ValueError, match="BusyClock"):
        run_lockstep([OfflineRun(slow, reqs, progress=False)])
