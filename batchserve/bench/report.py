"""Summaries as text tables (one run, or runs side by side with a ratio) and as strict JSON."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from pathlib import Path
from typing import Any

# (label, key or (key, sub-key), format, scale)
ROWS: list[tuple[str, Any, str, float]] = [
    ("Requests completed", "completed", "{:.0f}", 1),
    ("Requests failed", "failed", "{:.0f}", 1),
    ("Duration (s)", "duration_s", "{:.2f}", 1),
    ("Request throughput (req/s)", "request_throughput", "{:.3f}", 1),
    ("Output throughput (tok/s)", "output_throughput", "{:.1f}", 1),
    ("  while requests waited (tok/s)", "output_throughput_saturated", "{:.1f}", 1),
    ("Total token throughput (tok/s)", "total_token_throughput", "{:.1f}", 1),
    ("Goodput (req/s within SLO)", "goodput", "{:.3f}", 1),
    ("SLO attainment (%)", "slo_attainment", "{:.1f}", 100),
]
LATENCIES = {"ttft": ("TTFT", "ttft_ms"), "tpot": ("TPOT", "tpot_ms"), "itl": ("ITL", "itl_ms"),
             "e2el": ("E2E latency", "e2e_ms")}  # fmt: skip
for _name, _key in LATENCIES.values():
    ROWS += [(f"{_name} {q} (ms)", (_key, q), "{:.1f}", 1) for q in ("mean", "p50", "p90", "p99")]
ROWS += [
    ("Engine steps", "num_steps", "{:.0f}", 1),
    ("Batch occupancy (%)", "batch_occupancy", "{:.1f}", 100),
    ("  while requests waited (%)", "batch_occupancy_saturated", "{:.1f}", 100),
    ("Mean sequences / step", "mean_seqs_per_step", "{:.2f}", 1),
    ("Mean tokens / step", "mean_tokens_per_step", "{:.1f}", 1),
    ("Output tokens / step", "output_tokens_per_step", "{:.2f}", 1),
    ("Mean step time (ms)", "mean_step_ms", "{:.2f}", 1),
    ("KV usage mean (%)", "kv_usage_mean", "{:.1f}", 100),
    ("KV usage max (%)", "kv_usage_max", "{:.1f}", 100),
    ("Preemptions", "num_preemptions", "{:.0f}", 1),
    ("Prefix cache hit rate (%)", "prefix_cache_hit_rate", "{:.1f}", 100),
    ("Draft tokens accepted (%)", "spec_acceptance_rate", "{:.1f}", 100),
    ("Tokens / verification step", "spec_tokens_per_verify", "{:.2f}", 1),
]


def _get(summary: dict[str, Any], key: Any) -> float | None:
    value = summary.get(key[0], {}).get(key[1]) if isinstance(key, tuple) else summary.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return None
    return float(value)


def _cell(value: float | None, fmt: str, scale: float) -> str:
    return "-" if value is None else fmt.format(value * scale)


def format_table(
    summaries: dict[str, dict[str, Any]], title: str = "", ratio: bool = True, latencies: Iterable[str] = LATENCIES
) -> str:
    """Rows of metrics, one column per run; with two runs and ratio=True a last column second/first. `latencies`:
    the ones whose percentiles are shown (vLLM's names: ttft, tpot, itl, e2el)."""
    hidden = {LATENCIES[name][1] for name in LATENCIES if name not in set(latencies)}
    names = list(summaries)
    show_ratio = ratio and len(names) == 2
    header = ["metric", *names] + ([f"{names[1]}/{names[0]}"] if show_ratio else [])
    rows = [header]
    for label, key, fmt, scale in ROWS:
        if isinstance(key, tuple) and key[0] in hidden:
            continue
        values = [_get(summaries[n], key) for n in names]
        if all(v is None for v in values):
            continue
        row = [label] + [_cell(v, fmt, scale) for v in values]
        if show_ratio:
            a, b = values
            row.append(f"{b / a:.3f}" if a and b is not None else "-")
        rows.append(row)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = [title, "=" * len(title)] if title else []
    for i, row in enumerate(rows):
        lines.append(
            "  ".join(c.ljust(w) if j == 0 else c.rjust(w) for j, (c, w) in enumerate(zip(row, widths, strict=False)))
        )
        if i == 0:
            lines.append("-" * len(lines[-1]))
    slo = next(iter(summaries.values()))
    if "slo_ttft_ms" in slo:
        ttft, tpot = slo["slo_ttft_ms"], slo["slo_tpot_ms"]
        lines.append(f"SLO: TTFT <= {ttft:g} ms and TPOT <= {tpot:g} ms (goodput counts the requests within both)")
    return "\n".join(lines)


def clean_json(obj: Any) -> Any:
    """NaN / inf -> None, tuples -> lists, so the file is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): clean_json(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [clean_json(v) for v in obj]
    return obj


def save_json(obj: Any, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(clean_json(obj), indent=2, allow_nan=False))
    return path
