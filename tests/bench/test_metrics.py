import math

import pytest

from batchserve.bench.metrics import (
    SLO,
    RequestResult,
    StepSample,
    batch_occupancy,
    padding_bound,
    percentile,
    step_summary,
    summarize,
)


def test_percentile_interpolates_like_numpy():
    xs = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0]
    assert percentile(xs, 50) == pytest.approx(5.5)
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 99) == pytest.approx(9.91)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 10.0
    assert percentile([3.0], 99) == 3.0
    assert math.isnan(percentile([], 50))
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0  # unsorted input


def test_request_latency_definitions():
    r = RequestResult(
        "a",
        prompt_len=10,
        output_len=5,
        arrival_time=100.0,
        first_token_time=100.2,
        finish_time=101.0,
        token_times=[100.2, 100.4, 100.6, 100.8, 101.0],
    )
    assert r.ttft == pytest.approx(0.2)
    assert r.e2e == pytest.approx(1.0)
    assert r.tpot == pytest.approx((1.0 - 0.2) / 4)
    assert r.itls == pytest.approx([0.2, 0.2, 0.2, 0.2])
    one = RequestResult("b", 10, 1, 0.0, 0.3, 0.3, [0.3])
    assert one.tpot is None and one.itls == []


def _result(rid, ttft, tpot, n=11, arrival=0.0):
    return RequestResult(rid, 8, n, arrival, arrival + ttft, arrival + ttft + tpot * (n - 1))


def test_slo_and_goodput():
    slo = SLO(ttft_s=0.5, tpot_s=0.1)
    results = [
        _result("fast", 0.1, 0.05),  # meets both
        _result("slow-start", 0.6, 0.05),  # TTFT over
        _result("slow-decode", 0.1, 0.15),  # TPOT over
        _result("edge", 0.5, 0.1),  # exactly on the limits: met
        RequestResult("single", 8, 1, 0.0, 0.2, 0.2),  # no TPOT: only TTFT counts
        RequestResult("failed", 8, 0, 0.0, success=False),
    ]
    assert [slo.met_by(r) for r in results] == [True, False, False, True, True, False]
    s = summarize(results, duration_s=2.0, slo=slo)
    assert s["goodput"] == pytest.approx(3 / 2.0)
    assert s["slo_attainment"] == pytest.approx(3 / 6)
    assert s["completed"] == 5 and s["failed"] == 1
    assert s["total_output_tokens"] == 11 * 4 + 1
    assert s["output_throughput"] == pytest.approx((11 * 4 + 1) / 2.0)
    assert s["total_token_throughput"] == pytest.approx((11 * 4 + 1 + 8 * 5) / 2.0)
    assert s["request_throughput"] == pytest.approx(5 / 2.0)


def test_summary_distributions_in_ms():
    results = [_result(f"r{i}", ttft=0.1 * (i + 1), tpot=0.01 * (i + 1)) for i in range(4)]
    s = summarize(results, 1.0)
    assert s["ttft_ms"]["mean"] == pytest.approx(250.0)
    assert s["ttft_ms"]["p50"] == pytest.approx(250.0)
    assert s["ttft_ms"]["p99"] == pytest.approx(100 + 300 * 0.99 * 3 / 3)
    assert s["tpot_ms"]["p90"] == pytest.approx(10 + 30 * 0.9)
    assert s["e2e_ms"]["mean"] == pytest.approx(1000 * sum(0.1 * (i + 1) + 0.1 * (i + 1) for i in range(4)) / 4)


def test_batch_occupancy_and_step_summary():
    steps = [
        StepSample(
            0.0, 0.1, num_scheduled_seqs=4, max_batch_size=4, num_waiting=2, kv_blocks_total=10, kv_blocks_used=5
        ),
        StepSample(
            0.1, 0.2, num_scheduled_seqs=2, max_batch_size=4, num_waiting=1, kv_blocks_total=10, kv_blocks_used=3
        ),
        StepSample(
            0.2,
            0.3,
            num_scheduled_seqs=1,
            max_batch_size=4,
            num_waiting=0,
            kv_blocks_total=10,
            kv_blocks_used=1,
            prefix_cache_queries=100,
            prefix_cache_hits=25,
        ),
    ]
    assert batch_occupancy(steps) == pytest.approx(7 / 12)
    s = summarize([_result("a", 0.1, 0.01)], 1.0, steps=steps)
    assert s["batch_occupancy"] == pytest.approx(7 / 12)
    assert s["batch_occupancy_saturated"] == pytest.approx(6 / 8)
    assert s["kv_usage_mean"] == pytest.approx(0.3) and s["kv_usage_max"] == pytest.approx(0.5)
    assert s["mean_step_ms"] == pytest.approx(100.0)
    assert s["prefix_cache_hit_rate"] == pytest.approx(0.25)


def test_request_level_prefix_hit_rate_without_steps():
    a = RequestResult("a", 100, 2, 0.0, 0.1, 0.2, num_cached_tokens=50)
    b = RequestResult("b", 100, 2, 0.0, 0.1, 0.2)
    assert summarize([a, b], 1.0)["prefix_cache_hit_rate"] == pytest.approx(0.25)


def test_saturated_throughput_stops_when_the_queue_empties():
    # steps of 1 s; requests waited during the first two; afterwards the batch drains at one token a step
    steps = [StepSample(start=float(i), end=float(i + 1), num_scheduled_seqs=2, num_waiting=w) for i, w in
             enumerate([3, 1, 0, 0])]  # fmt: skip
    busy = RequestResult("a", 8, 4, 0.0, 1.0, 4.0, [1.0, 2.0, 3.0, 4.0])
    other = RequestResult("b", 8, 2, 0.0, 1.0, 2.0, [1.0, 2.0])
    summary = summarize([busy, other], 4.0, steps=steps)
    assert summary["output_throughput_saturated"] == pytest.approx(4 / 2.0)  # 4 tokens by t=2, over 2 s
    assert summary["output_throughput"] == pytest.approx(6 / 4.0)
    never_waited = [StepSample(start=0.0, end=1.0, num_scheduled_seqs=1)]
    assert math.isnan(summarize([other], 1.0, steps=never_waited)["output_throughput_saturated"])


def test_padding_bound_counts_only_decode_time_as_padded():
    def step(start: float, seconds: float, seqs: int, prefill: int) -> StepSample:
        return StepSample(start, start + seconds, num_scheduled_seqs=seqs, max_batch_size=4, num_waiting=1,
                          num_prefill_tokens=prefill, num_decode_tokens=seqs)  # fmt: skip

    # static: 1 s of prefill, then 3 decode steps of 1 s at 4, 3 and 1 useful rows (8 of 12 slots)
    static = step_summary([step(0, 1, 4, 40), step(1, 1, 4, 0), step(2, 1, 3, 0), step(3, 1, 1, 0)])
    dynamic = step_summary([step(0, 1, 4, 10), step(1, 1, 4, 0)])
    assert static["prefill_time_share_saturated"] == pytest.approx(0.25)
    # 3 s of decode at 8/12 occupied could be 2 s at full occupancy, the 1 s of prefill stays: 4 s -> 3 s
    assert padding_bound(static, dynamic) == pytest.approx(4 / 3)
    assert padding_bound(static, {**dynamic, "batch_occupancy_saturated": math.nan}) != padding_bound(static, dynamic)
