"""What a `bench` run leaves behind: per-run traces (JSON, Perfetto) and pictures, the sweep's curve, and the
static-vs-dynamic verdict line."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from batchserve.bench.metrics import padding_bound
from batchserve.bench.trace import RunTrace, save_chrome_trace


def run_label(policy: str, rate: float | None) -> str:
    return policy if rate is None else f"{policy}@{rate:g}"


def write_outputs(args: argparse.Namespace, traces: dict[str, RunTrace], summaries: dict, out: Path) -> list[Path]:
    files = []
    for label, trace in traces.items():
        safe = label.replace("@", "-at-")
        trace.save_json(out / f"trace-{safe}.json")
        files.append(out / f"trace-{safe}.json")
        if trace.steps:
            save_chrome_trace(trace, out / f"trace-{safe}.perfetto.json")
            files.append(out / f"trace-{safe}.perfetto.json")
        if not args.no_plots:
            files += _run_plots(args, trace, out / safe)
    if args.no_plots or not traces:
        return files
    from batchserve.bench.plots import plot_latency_cdfs, plot_throughput_latency

    files.append(plot_latency_cdfs(list(traces.values()), out / "latency-cdf.png"))
    if args.sweep_rates and all(t.meta.get("request_rate") is not None for t in traces.values()):
        points = [
            {**s, "label": traces[lbl].meta.get("policy", "http"), "request_rate": traces[lbl].meta["request_rate"]}
            for lbl, s in summaries.items()
        ]
        files.append(plot_throughput_latency(points, out / "throughput-latency.png"))
    return files


def _run_plots(args: argparse.Namespace, trace: RunTrace, stem: Path) -> list[Path]:
    """Throughput over time for every run (client timestamps, so HTTP runs too); offline runs add the batch
    timeline and the KV blocks, both per engine step."""
    from batchserve.bench.plots import plot_batch_timeline, plot_kv_usage, plot_throughput_over_time

    files = [plot_throughput_over_time(trace, stem.with_name(f"throughput-{stem.name}.png"))]
    if trace.steps:
        files.append(plot_batch_timeline(trace, stem.with_name(f"timeline-{stem.name}.png"), args.timeline_steps))
        files.append(plot_kv_usage(trace, stem.with_name(f"kv-{stem.name}.png"), args.timeline_steps))
    return files


def compare_line(summaries: dict[str, dict], keys: list[tuple]) -> str:
    """The static-vs-dynamic verdict: measured throughput, and output tokens per step (the same ratio with the
    hardware's speed taken out: what batching alone gained), with both occupancies."""
    lines = []
    for rate in dict.fromkeys(k[2] for k in keys):
        s, d = summaries[run_label("static", rate)], summaries[run_label("max_utilization", rate)]
        where = "" if rate is None else f" at {rate:g} req/s"
        lines.append(
            f"dynamic vs static{where}: output throughput {_ratio(d, s, 'output_throughput')} "
            f"(saturated, while requests waited: {_ratio(d, s, 'output_throughput_saturated')}), "
            f"output tokens/step {_ratio(d, s, 'output_tokens_per_step')}; batch occupancy "
            f"{100 * s.get('batch_occupancy', math.nan):.1f}% static vs {100 * d.get('batch_occupancy', math.nan):.1f}% "
            f"dynamic (while requests waited: {100 * s.get('batch_occupancy_saturated', math.nan):.1f}% vs "
            f"{100 * d.get('batch_occupancy_saturated', math.nan):.1f}%)"
        )
        bound = padding_bound(s, d)
        if math.isfinite(bound):
            lines.append(
                f"  padding bound{where}: {bound:.3f}x (the most that removing static's padding can gain while "
                f"requests wait: static spent {100 * s['prefill_time_share_saturated']:.0f}% of that time in "
                "prefill steps, which have no padding)"
            )
    return "\n".join(lines)


def _ratio(a: dict, b: dict, key: str) -> str:
    x, y = a.get(key), b.get(key)
    if not x or not y:
        return "n/a"
    return f"{x / y:.3f}x ({100 * (x / y - 1):+.1f}%)"
