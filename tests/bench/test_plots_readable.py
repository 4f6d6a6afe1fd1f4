"""The pictures as a reader sees them: no request's colour reads as the prefill legend's, enter / finish
markers big enough to see, latency CDF axes that end near the high percentile, every step of a long run drawn."""

from __future__ import annotations

import numpy as np
import pytest

from batchserve.bench.metrics import RequestResult, StepSample
from batchserve.bench.trace import RunTrace
from tests.lazy import LazyModule

# matplotlib (most of a second of CPU) is imported by the tests that draw, not by every worker that collects them
plots = LazyModule("batchserve.bench.plots")


def test_no_request_colour_looks_like_a_legend_kind():
    from batchserve.bench.plots import _padding_colour, _request_colour

    legend = [plots.LEGEND_DECODE, plots.LEGEND_PREFILL]  # padding is every request's colour faded: near grey
    for index in range(200):
        colour = _request_colour(index)
        for shown in (colour, colour * plots.PREFILL_DARKENING, _padding_colour(colour)):
            assert min(np.abs(shown - kind).max() for kind in legend) > 0.1, (index, shown)


@pytest.mark.parametrize("columns", [5, 600, 1500])
def test_markers_are_at_least_six_points(columns):
    assert plots.marker_size(columns, 32) >= 36


def test_a_latency_cdf_axis_ends_near_the_high_percentile():
    values = [float(v) for v in range(1, 1001)] + [500_000.0]
    limit = plots.cdf_axis_limit(values)
    assert 995 < limit < 1100
    assert plots.cdf_axis_limit([5.0, 6.0, 7.0]) == 7.0  # nothing to clip
    assert plots.cdf_axis_limit([]) is None


def captured(monkeypatch):
    figures = []

    def keep(fig, path):
        figures.append(fig)
        return path

    monkeypatch.setattr("batchserve.bench.plots._save", keep)
    return figures


def long_trace(num_steps: int) -> RunTrace:
    steps = [StepSample(float(i), i + 0.5, num_scheduled_seqs=2, max_batch_size=2,
                        scheduled={f"r{i // 40}-{j}": (1, i % 40 == 0) for j in range(2)},
                        finished=[f"r{i // 40}-{j}" for j in range(2)] if i % 40 == 39 else [])
             for i in range(num_steps)]  # fmt: skip
    return RunTrace("static", 0.0, 2, steps, [])


def test_every_step_of_a_long_run_is_drawn_and_the_subsample_stated(monkeypatch, tmp_path):
    figures = captured(monkeypatch)
    plots.plot_batch_timeline(long_trace(2044), tmp_path / "t.png")
    axis = figures[-1].axes[0]
    assert axis.images[0].get_array().shape[1] == 1022  # 2044 steps, one column per 2
    assert "all 2044 steps, one column per 2 steps" in axis.get_title("left")
    plots.plot_batch_timeline(long_trace(700), tmp_path / "t.png")
    assert figures[-1].axes[0].images[0].get_array().shape[1] == 700
    assert "all 700 steps" in figures[-1].axes[0].get_title("left")


def test_latency_cdfs_say_where_they_clip(monkeypatch, tmp_path):
    figures = captured(monkeypatch)
    requests = [RequestResult(f"r{i}", 4, 2, 0.0, 0.01 * (i + 1), 0.02 * (i + 1), [0.01 * (i + 1), 0.02 * (i + 1)])
                for i in range(400)] + [RequestResult("slow", 4, 2, 0.0, 500.0, 501.0, [500.0, 501.0])]  # fmt: skip
    plots.plot_latency_cdfs([RunTrace("http", 0.0, 1, [], requests)], tmp_path / "cdf.png")
    ttft_axis = figures[-1].axes[0]
    assert ttft_axis.get_xlim()[1] < 10_000 and "axis ends at p99.5" in ttft_axis.get_xlabel()
