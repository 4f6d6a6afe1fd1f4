"""The simulator's schedule is the real engine's: the same Scheduler and KVCacheManager code, driven the same way.
The real LLMEngine runs over the FakeRunner (which checks the block tables by reading its tokens back through them)
on a virtual clock advanced by a step model; the simulator runs the same workload with the same step model; every
SchedulerOutput must match, and so must every request's latencies."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from batchserve.bench.arrivals import ArrivalProcess
from batchserve.bench.metrics import summarize
from batchserve.bench.workloads import WorkloadOptions, make_workload
from batchserve.simulator.cluster import Cluster
from batchserve.simulator.engine import SimEngine
from batchserve.simulator.router import RoundRobin
from tests.simulator.helpers import STEP_MODEL, decisions, run_real

CASES = {
    # a pool too small for the batch: max_utilization preempts and recomputes
    "uniform-preempting": ("uniform", dict(max_batch_size=8, num_kv_blocks=24, block_size=8), dict(input_len=24)),
    "longtail-chunked": ("longtail", dict(max_batch_size=6, max_num_tokens=40, num_kv_blocks=64, block_size=8), {}),
    "shared-prefix-hits": ("shared-prefix", dict(max_batch_size=8, num_kv_blocks=96, block_size=8),
                           dict(prefix_len=40, input_len=12)),
    "swap": ("uniform", dict(max_batch_size=8, num_kv_blocks=24, block_size=8, preemption_mode="swap",
                             num_swap_blocks=32), dict(input_len=24)),
    "static": ("longtail", dict(max_batch_size=4, scheduler_policy="static", num_kv_blocks=128, block_size=8), {}),
    # long-prompt isolation: long prompts chunked to 16 tokens, one long and two prompts in all prefilling at once
    "long-prefill-limits": ("longtail", dict(max_batch_size=6, max_num_tokens=48, num_kv_blocks=96, block_size=8,
                                             long_prefill_token_threshold=16, max_long_partial_prefills=1,
                                             max_num_partial_prefills=2), {}),
    # SLO admission on the step-time fit both learn from the same modelled steps: refusals, drops, slack victims
    "slo-refuse": ("longtail", dict(max_batch_size=4, max_num_tokens=40, num_kv_blocks=48, block_size=8,
                                    slo_admission="refuse", ttft_slo_ms=40, max_preemptions_per_request=2), {}),
    "slo-deprioritize": ("longtail", dict(max_batch_size=4, max_num_tokens=40, num_kv_blocks=48, block_size=8,
                                          slo_admission="deprioritize", ttft_slo_ms=40), {}),
    # the slot reserve: summaries with a loose TTFT target wait for a regular slot, questions with a tight one take
    # the kept slot
    "slo-reserve": ("mixed", dict(max_batch_size=4, max_num_tokens=64, num_kv_blocks=96, block_size=8,
                                  slo_admission="refuse", slo_reserved_slots=1),
                    dict(input_len=8, long_input_len=24, long_output_len=40, long_ratio=0.5)),
    "no-evict-priority": ("uniform", dict(max_batch_size=8, scheduler_policy="guaranteed_no_evict",
                                          num_kv_blocks=40, block_size=8), dict(input_len=20)),
}  # fmt: skip


@pytest.mark.parametrize("rate", [math.inf, 300.0], ids=["all-at-once", "poisson-300"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_simulated_schedule_equals_the_engines(make_engine, case, rate):
    workload, options, shape = CASES[case]
    engine = make_engine(**options)
    requests = make_workload(workload, engine.tokenizer, 24, seed=3,
                             options=WorkloadOptions(output_len=12, max_output_len=40, **shape))  # fmt: skip
    if case == "slo-reserve":
        requests = [replace(r, ttft_slo_ms=2000.0 if r.category == "long" else 30.0) for r in requests]
    arrivals = ArrivalProcess(request_rate=rate)
    real, fake = run_real(engine, requests, arrivals, seed=3)

    sim = SimEngine(engine.config, STEP_MODEL, fake.num_kv_blocks, engine.limits.max_model_len,
                    num_swap_blocks=fake.num_swap_blocks)  # fmt: skip
    sim.runner.recorded = []
    simulated = Cluster([sim], RoundRobin(1)).run(requests, arrivals, seed=3).trace

    real_steps = [decisions(o) for o in fake.steps if not o.is_empty]
    sim_steps = [decisions(o) for o in sim.runner.recorded if not o.is_empty]
    assert len(real_steps) > 20
    for i, (a, b) in enumerate(zip(real_steps, sim_steps, strict=True)):
        assert a == b, f"step {i} differs"
    for a, b in zip(real.requests, simulated.requests, strict=True):
        assert (a.request_id, a.output_len, a.num_preemptions, a.num_cached_tokens) == (
            b.request_id, b.output_len, b.num_preemptions, b.num_cached_tokens)  # fmt: skip
        assert a.arrival_time == pytest.approx(b.arrival_time, abs=1e-12)
        assert a.token_times == pytest.approx(b.token_times, abs=1e-12)
    real_summary = summarize(real.requests, real.meta["duration_s"], steps=real.steps)
    sim_summary = summarize(simulated.requests, simulated.meta["duration_s"], steps=simulated.steps)
    for key in ("output_throughput", "num_steps", "step_preemptions", "kv_usage_max", "batch_occupancy"):
        assert sim_summary[key] == pytest.approx(real_summary[key], rel=1e-9), key
    for key in ("ttft_ms", "tpot_ms", "e2e_ms"):
        assert sim_summary[key] == pytest.approx(real_summary[key], rel=1e-9), key
    if case.startswith("slo-"):  # the case decides something: refusals or demotions, the same in both
        real_slo, sim_slo = engine.scheduler.slo, sim.scheduler.slo
        assert real_slo.num_refused + real_slo.num_demoted > 0
        assert (real_slo.num_refused, real_slo.num_demoted) == (sim_slo.num_refused, sim_slo.num_demoted)
    if case == "slo-reserve":
        held = engine.scheduler.reserve.num_held_back
        assert held > 0 and sim.scheduler.reserve.num_held_back == held
    if case == "long-prefill-limits":  # long prompts were chunked to the threshold
        assert any(16 in o.num_scheduled_tokens.values() for o in fake.steps)
    if case.startswith("uniform-preempting"):
        assert real_summary["step_preemptions"] > 0  # the case tests what it says
    if case == "shared-prefix-hits":
        assert real_summary["prefix_cache_hit_rate"] > 0.3
        assert sim_summary["prefix_cache_hit_rate"] == pytest.approx(real_summary["prefix_cache_hit_rate"])
