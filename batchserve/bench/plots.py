"""PNG pictures of a run (matplotlib, Agg backend): batch timeline and KV blocks per engine step (offline), latency
CDFs and throughput over time from the client's timestamps (any run, HTTP included), throughput vs latency (sweeps)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
from matplotlib.patches import Patch  # noqa: E402
from matplotlib.ticker import MaxNLocator  # noqa: E402

from batchserve.bench.trace import RunTrace, assign_lanes  # noqa: E402

IDLE = (0.94, 0.94, 0.94)
MAX_TIMELINE_COLUMNS = 1500  # more steps than this are drawn one in every k (the title says so)
PREFILL_DARKENING = 0.55

_PALETTE = [plt.get_cmap("tab20")(i)[:3] for i in range(20) if i not in (14, 15)]  # no greys: grey means idle
# The legend shows the kinds of cell in greys, which no request has, so that no request's colour reads as a kind
LEGEND_DECODE = np.array((0.55, 0.55, 0.55))
LEGEND_PREFILL = LEGEND_DECODE * PREFILL_DARKENING


def _request_colour(index: int) -> np.ndarray:
    return np.array(_PALETTE[(index * 7) % len(_PALETTE)])  # stride so neighbours differ


def _padding_colour(colour: np.ndarray) -> np.ndarray:
    return 0.3 * colour + 0.7 * np.array(IDLE)


def plot_batch_timeline(trace: RunTrace, path: str | Path, max_steps: int | None = None) -> Path:
    """One lane per batch slot (rows) over iterations (columns), coloured by request.

    Decode cells are the request's colour; prefill cells the same colour, darker and hatched with dots; padding
    (a finished member of a static batch, still computed) the same colour, faded; idle slots are light grey. A green
    triangle marks where a request enters the batch, a black cross where it finishes.
    The bottom panel shows the batch occupancy and the waiting queue per iteration.
    Every step is drawn (`max_steps`: only the first ones); past MAX_TIMELINE_COLUMNS steps a column shows one step
    in every k, the last of its k, and the title says so.
    """
    steps = trace.steps[:max_steps] if max_steps else trace.steps
    stride = -(-len(steps) // MAX_TIMELINE_COLUMNS) if steps else 1
    cells = _timeline_cells(trace, steps, stride)
    num_lanes, columns = cells.image.shape[:2]
    height = min(3 + num_lanes * 0.18, 14)
    fig, (ax, ax2) = plt.subplots(
        2, 1, figsize=(min(6 + columns * 0.03, 22), height + 2), sharex=True,
        gridspec_kw={"height_ratios": [height, 2]},
    )  # fmt: skip
    ax.imshow(cells.image, aspect="auto", interpolation="nearest", origin="lower",
              extent=(-0.5, columns * stride - 0.5, -0.5, num_lanes - 0.5))  # fmt: skip
    _draw_markers(ax, cells, marker_size(columns, num_lanes), stride)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True, nbins=min(num_lanes, 16)))
    ax.set_ylabel("batch slot")
    ax.set_title(f"Batch timeline: {trace.label} ({_shown(len(steps), len(trace.steps), stride)}, "
                 f"max_batch_size={trace.max_batch_size})", loc="left")  # fmt: skip
    _timeline_legend(ax)
    _occupancy_panel(ax2, steps)
    return _save(fig, path)


@dataclass
class _TimelineCells:
    image: np.ndarray  # [lanes, columns, rgb]
    prefills: list[tuple[int, int]] = field(default_factory=list)  # (step, lane) of each prefill cell
    inserts: list[tuple[int, int]] = field(default_factory=list)  # where a request enters its lane
    exits: list[tuple[int, int]] = field(default_factory=list)  # where it finishes


def _timeline_cells(trace: RunTrace, steps: list, stride: int) -> _TimelineCells:
    """Each lane's cells coloured by request (one column per `stride` steps), and where the markers go."""
    lanes = assign_lanes(steps, trace.max_batch_size)
    num_lanes = max(trace.max_batch_size, max((max(r, default=-1) + 1 for r in lanes), default=0))
    columns = max(-(-len(steps) // stride), 1)
    cells = _TimelineCells(np.ones((num_lanes, columns, 3)) * np.array(IDLE))
    order = {r.request_id: i for i, r in enumerate(trace.requests)}
    for x, (step, row) in enumerate(zip(steps, lanes, strict=True)):
        for lane, (rid, ntok, prefill) in row.items():
            colour = _request_colour(order.setdefault(rid, len(order)))
            cells.image[lane, x // stride] = (
                colour * PREFILL_DARKENING if prefill else colour if ntok else _padding_colour(colour)
            )
            if prefill:
                cells.prefills.append((x, lane))
            if x == 0 or lanes[x - 1].get(lane, ("",))[0] != rid:
                cells.inserts.append((x, lane))
            if rid in step.finished:
                cells.exits.append((x, lane))
    return cells


def _draw_markers(ax, cells: _TimelineCells, size: float, stride: int) -> None:
    if cells.prefills:
        px, py = zip(*cells.prefills, strict=True)
        ax.scatter(px, py, s=size * 0.3, c="white", marker=".", linewidths=0)
    if cells.inserts:
        ix, iy = zip(*cells.inserts, strict=True)
        # above the crosses: a slot refilled at the next step shows both
        ax.scatter(np.array(ix) - 0.2 * stride, iy, s=size, c="lime", marker=">", edgecolors="darkgreen",
                   linewidths=0.8, zorder=5)  # fmt: skip
    if cells.exits:
        ex, ey = zip(*cells.exits, strict=True)
        ax.scatter(ex, ey, s=size, c="black", marker="x", linewidths=1.5, zorder=4)


def _timeline_legend(ax) -> None:
    ax.legend(
        handles=[
            Patch(color=LEGEND_DECODE, label="decode (each request its own colour)"),
            Patch(facecolor=LEGEND_PREFILL, edgecolor="white", hatch="..", label="prefill (its colour darker, dotted)"),
            Patch(color=_padding_colour(LEGEND_DECODE), label="padding (finished, still computed; faded)"),
            Patch(color=IDLE, label="idle slot"),
            plt.Line2D([], [], color="lime", markeredgecolor="darkgreen", marker=">", ls="", label="enters batch"),
            plt.Line2D([], [], color="black", marker="x", ls="", label="finishes"),
        ],
        loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=8,
    )  # fmt: skip


def _occupancy_panel(ax2, steps: list) -> None:
    """Batch occupancy and the waiting queue per iteration, under the timeline."""
    xs = np.arange(len(steps))
    ax2.plot(xs, [100 * s.num_scheduled_seqs / s.max_batch_size for s in steps], color="tab:blue", label="occupancy %")
    ax2.set_ylabel("occupancy %")
    ax2.set_ylim(0, 105)
    ax2.set_xlabel("iteration (engine step)")
    ax3 = ax2.twinx()
    ax3.plot(xs, [s.num_waiting for s in steps], color="tab:orange", label="waiting")
    ax3.set_ylabel("waiting requests", color="tab:orange")


def marker_size(columns: int, lanes: int) -> float:
    """Enter / finish marker area (points^2): about a cell, never smaller than a readable 6-point marker."""
    cell_points = min(72 * min(6 + columns * 0.03, 22) / columns, 72 * min(3 + lanes * 0.18, 14) / max(lanes, 1))
    return max(36.0, min(100.0, (0.9 * cell_points) ** 2))


def _shown(drawn: int, total: int, stride: int) -> str:
    first = f"first {drawn} of {total} steps" if total > drawn else f"all {total} steps"
    return first if stride == 1 else f"{first}, one column per {stride} steps"


def plot_kv_usage(trace: RunTrace, path: str | Path, timeline_steps: int | None = None) -> Path:
    """KV blocks per engine step (the batch timeline's axis), stacked: in use by requests, free but holding cached
    prefixes, free and empty. A dotted line marks where the timeline, showing `timeline_steps` steps, stops."""
    steps = trace.steps
    t = list(range(len(steps)))
    used = [s.kv_blocks_used for s in steps]
    cached = [s.kv_blocks_cached_free for s in steps]
    empty = [max(s.kv_blocks_free - s.kv_blocks_cached_free, 0) for s in steps]
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.stackplot(t, used, cached, empty, labels=["in use", "cached (free, reusable)", "free"],
                 colors=["tab:red", "tab:olive", "0.85"], step="post")  # fmt: skip
    ax.set_xlabel("iteration (engine step)")
    if timeline_steps is not None and len(steps) > timeline_steps:
        ax.axvline(timeline_steps - 0.5, color="black", linestyle=":", linewidth=1, label="batch timeline ends")
    ax.set_ylabel("KV blocks")
    ax.set_title(f"KV cache blocks: {trace.label}")
    ax.legend(loc="upper right", fontsize=8)
    if steps:
        ax.set_ylim(0, max(s.kv_blocks_total for s in steps) or 1)
    return _save(fig, path)


def plot_throughput_latency(points: Sequence[dict[str, Any]], path: str | Path) -> Path:
    """A rate sweep: each point is a summary dict (metrics.summarize) with 'request_rate' and optional 'label'.

    Left: output tokens/s vs TTFT (p50, p99); right: vs TPOT (p50, p99). Each point is annotated with its rate.
    """
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    labels = sorted({p.get("label", "") for p in points})
    for label, colour in zip(labels, plt.get_cmap("tab10").colors, strict=False):
        series = sorted((p for p in points if p.get("label", "") == label), key=lambda p: p["output_throughput"])
        x = [p["output_throughput"] for p in series]
        for ax, key in zip(axes, ("ttft_ms", "tpot_ms"), strict=True):
            for q, style in (("p50", "-o"), ("p99", "--^")):
                ax.plot(x, [p[key][q] for p in series], style, color=colour, label=f"{label} {q}".strip())
            for p in series:
                ax.annotate(f"{p['request_rate']:g}/s", (p["output_throughput"], p[key]["p50"]), fontsize=7,
                            textcoords="offset points", xytext=(3, 3))  # fmt: skip
    for ax, key in zip(axes, ("TTFT (ms)", "TPOT (ms)"), strict=True):
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel(key)
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Throughput vs latency over a sweep of request rates")
    return _save(fig, path)


def plot_latency_cdfs(traces: Sequence[RunTrace], path: str | Path) -> Path:
    """TTFT, TPOT, ITL and E2E latency CDFs, one line per run, from each request's timings as its client saw them."""
    fig, axes = plt.subplots(1, 4, figsize=(18, 4))
    metrics = (("TTFT", lambda r: [r.ttft]), ("TPOT", lambda r: [r.tpot]), ("ITL", lambda r: r.itls),
               ("E2E latency", lambda r: [r.e2e]))  # fmt: skip
    for ax, (name, values_of) in zip(axes, metrics, strict=True):
        everything: list[float] = []
        for trace in traces:
            values = sorted(1000 * v for r in trace.requests if r.success for v in values_of(r) if v is not None)
            if values:
                ax.step(values, np.arange(1, len(values) + 1) / len(values), where="post", label=trace.label)
                everything += values
        clip = cdf_axis_limit(everything)
        ax.set_xlim(0, clip)
        clipped = clip is not None and clip < max(everything)
        ax.set_xlabel(
            f"{name} (ms)" + (f"; axis ends at p{CDF_CLIP_PERCENTILE:g}, max {max(everything):.0f}" if clipped else "")
        )
        ax.set_ylabel("share of requests" if name != "ITL" else "share of token gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Latency distributions (client timestamps)")
    return _save(fig, path)


CDF_CLIP_PERCENTILE = 99.5


def cdf_axis_limit(values: Sequence[float]) -> float | None:
    """Where a latency CDF's x axis ends: a little past the high percentile, so that a few stragglers (or one
    request that waited minutes) do not squeeze every other curve against the axis."""
    if not values:
        return None
    high = float(np.percentile(values, CDF_CLIP_PERCENTILE))
    return min(max(values), 1.05 * high) if high > 0 else max(max(values), 1.0)


def plot_throughput_over_time(trace: RunTrace, path: str | Path, num_bins: int = 50) -> Path:
    """Output tokens/s in `num_bins` bins over the run from the client's token timestamps (a chunk carrying k tokens
    counts k), and the requests in flight: ramp-up, steady state and tail of one run."""
    stamps, weights, spans = [], [], []
    for r in trace.requests:
        if r.success and r.token_times:
            stamps += [t - trace.t0 for t in r.token_times]
            weights += [r.output_len / len(r.token_times)] * len(r.token_times)
        if r.finish_time is not None:
            spans.append((r.arrival_time - trace.t0, r.finish_time - trace.t0))
    end = max([*stamps, *(b for _, b in spans), 1e-3])
    bin_s = end / num_bins
    edges = np.linspace(0.0, end, num_bins + 1)
    tokens, _ = np.histogram(stamps, bins=edges, weights=weights)
    fig, ax = plt.subplots(figsize=(10, 4))
    ax.bar(edges[:-1], tokens / bin_s, width=bin_s, align="edge", color="tab:blue", label="output tokens/s")
    ax.set_xlabel("time since the run started (s)")
    ax.set_ylabel("output tokens/s")
    ax2 = ax.twinx()
    in_flight = [sum(a <= t < b for a, b in spans) for t in edges[:-1]]
    ax2.step(edges, [*in_flight, in_flight[-1]], where="post", color="tab:orange")
    ax2.set_ylim(0, max(in_flight, default=0) + 1)
    ax2.set_ylabel("requests in flight", color="tab:orange")
    ax.set_title(f"Throughput over time: {trace.label}")
    return _save(fig, path)


def _save(fig: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
