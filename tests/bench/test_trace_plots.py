import json

from batchserve.bench.metrics import RequestResult, StepSample
from batchserve.bench.trace import RunTrace, assign_lanes, chrome_trace, save_chrome_trace
from tests.lazy import LazyModule

# matplotlib (most of a second of CPU) is imported by the tests that draw, not by every worker that collects them
plots = LazyModule("batchserve.bench.plots")


def _step(i, scheduled, finished=(), waiting=0):
    used = 2 * len(scheduled)
    return StepSample(
        float(i),
        i + 0.5,
        num_scheduled_seqs=len(scheduled),
        max_batch_size=3,
        num_waiting=waiting,
        kv_blocks_total=20,
        kv_blocks_used=used,
        kv_blocks_free=20 - used,
        kv_blocks_cached_free=1,
        scheduled=dict(scheduled),
        finished=list(finished),
    )


def synthetic_trace() -> RunTrace:
    steps = [
        _step(0, {"a": (5, True), "b": (7, True)}, waiting=2),
        _step(1, {"a": (1, False), "b": (1, False)}, ["a"], waiting=2),
        _step(2, {"c": (4, True), "b": (1, False)}, waiting=1),
        _step(3, {"b": (1, False), "c": (1, False), "d": (3, True)}, ["b"]),
        _step(4, {"c": (1, False), "d": (1, False)}, ["c", "d"]),
    ]
    reqs = [RequestResult(r, 5, 2, 0.0, 0.5 + i, 2.0 + i, [0.5 + i, 2.0 + i]) for i, r in enumerate("abcd")]
    return RunTrace("synthetic", 0.0, 3, steps, reqs, {"duration_s": 5.0})


def test_lanes_are_stable_and_reused():
    lanes = assign_lanes(synthetic_trace().steps, 3)
    assert lanes[0] == {0: ("a", 5, True), 1: ("b", 7, True)}
    assert lanes[1][0][0] == "a" and lanes[1][1][0] == "b"
    assert lanes[2] == {0: ("c", 4, True), 1: ("b", 1, False)}  # c takes a's freed lane, b stays put
    assert lanes[3][2] == ("d", 3, True)
    assert lanes[4] == {0: ("c", 1, False), 2: ("d", 1, False)}


def test_padding_keeps_its_lane_and_is_marked():
    steps = [
        _step(0, {"a": (1, False), "b": (1, False)}, finished=["a"]),
        _step(1, {"b": (1, False)}),
        _step(2, {"b": (1, False)}, finished=["b"]),
        _step(3, {"c": (4, True)}),
    ]
    steps[1].padding = steps[2].padding = ["a"]
    lanes = assign_lanes(steps, 2)
    assert lanes[1] == {0: ("a", 0, False), 1: ("b", 1, False)}  # a stays on its lane as padding (0 tokens)
    assert lanes[2][0] == ("a", 0, False)
    assert lanes[3] == {0: ("c", 4, True)}  # the lane is free once the padding is gone


def test_trace_json_round_trip(tmp_path):
    trace = synthetic_trace()
    trace.save_json(tmp_path / "t.json")
    back = RunTrace.load_json(tmp_path / "t.json")
    assert back == trace


def test_chrome_trace_events(tmp_path):
    trace = synthetic_trace()
    events = chrome_trace(trace)["traceEvents"]
    slices = [e for e in events if e["ph"] == "X"]
    assert len(slices) == sum(len(s.scheduled) for s in trace.steps)
    first = next(e for e in slices if e["name"] == "a")
    assert first["ts"] == 0 and first["dur"] == 500000 and first["cat"] == "prefill"
    assert {e["name"] for e in events if e["ph"] == "C"} == {"kv blocks", "requests"}
    assert sum(e["ph"] == "b" for e in events) == 4 and sum(e["ph"] == "e" for e in events) == 4
    save_chrome_trace(trace, tmp_path / "t.perfetto.json")
    assert json.loads((tmp_path / "t.perfetto.json").read_text())["traceEvents"]


def _png_ok(path):
    data = path.read_bytes()
    return len(data) > 1000 and data[:8] == b"\x89PNG\r\n\x1a\n"


def test_plots_render(tmp_path):
    trace = synthetic_trace()
    assert _png_ok(plots.plot_batch_timeline(trace, tmp_path / "timeline.png"))
    assert _png_ok(plots.plot_kv_usage(trace, tmp_path / "kv.png"))
    points = [
        {
            "label": lbl,
            "request_rate": rate,
            "output_throughput": 10 * rate * k,
            "ttft_ms": {"p50": 50 * rate, "p99": 90 * rate},
            "tpot_ms": {"p50": 20 + rate, "p99": 30 + rate},
        }
        for lbl, k in (("static", 0.8), ("max_utilization", 1.0))
        for rate in (1, 2, 4)
    ]
    assert _png_ok(plots.plot_throughput_latency(points, tmp_path / "sweep.png"))


def test_timeline_of_empty_and_long_runs(tmp_path):
    empty = RunTrace("empty", 0.0, 4)
    assert _png_ok(plots.plot_batch_timeline(empty, tmp_path / "empty.png"))
    steps = [_step(i, {f"r{i // 10}-{j}": (1, i % 10 == 0) for j in range(3)}) for i in range(1000)]
    long = RunTrace("long", 0.0, 3, steps, [])
    assert _png_ok(plots.plot_batch_timeline(long, tmp_path / "long.png", max_steps=300))
