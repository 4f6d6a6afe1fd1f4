"""`batchserve doctor`: watch a running server (--url) for a window, or read a bench trace file, and print what the
troubleshooting guide (docs/troubleshooting.md) would find, with the numbers and the simulator's predictions.

  batchserve doctor --url http://127.0.0.1:8000 --window 60
  batchserve doctor bench_results/run/trace-poisson.json --set max_num_tokens=2048 --set num_kv_blocks=4096
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from batchserve.doctor.observe import Observation, SourceError, from_trace_file, http_fetcher, watch
from batchserve.doctor.rules import Diagnosis, diagnose
from batchserve.simulator.profile_file import Profile


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="batchserve doctor", description=__doc__.split("\n\n")[0])
    p.add_argument("trace", nargs="?", help="a bench trace file (trace-*.json) instead of --url")
    p.add_argument("--url", help="a running batchserve server")
    p.add_argument("--api-key", default=None, help="the server's API key, if it has one")
    p.add_argument("--window", type=float, default=30.0, help="seconds to watch the server (default: 30)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KNOB=VALUE",
        help="the engine's configuration where the trace does not record it (max_num_tokens=2048)",
    )
    p.add_argument(
        "--profile", default=None, help="a step-time profile for predictions (default: fitted to the observed steps)"
    )
    p.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="the TTFT target goodput is judged by (default: the server's ttft_slo_ms)")  # fmt: skip
    p.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="the TPOT target goodput is judged by (default: the server's tpot_slo_ms)")  # fmt: skip
    p.add_argument("--no-simulate", action="store_true", help="findings without the simulator's predictions")
    p.add_argument("--json", action="store_true", help="print the findings as JSON")
    return p


def observe(args: argparse.Namespace) -> Observation:
    if args.url:
        print(f"watching {args.url} for {args.window:g} s ...", file=sys.stderr)
        obs = watch(http_fetcher(args.url, args.api_key), args.window)
    else:
        obs = from_trace_file(args.trace)
    for item in args.set:
        key, _, value = item.partition("=")
        obs.config[key.strip()] = value.strip()
    for key, value in (("ttft_slo_ms", args.slo_ttft_ms), ("tpot_slo_ms", args.slo_tpot_ms)):
        if value is not None:
            if not value > 0:
                raise SourceError(f"--slo-{key[:4]}-ms must be > 0, got {value:g}")
            obs.config[key] = value
    return obs


def render(obs: Observation, diagnosis: Diagnosis) -> str:
    lines = [
        f"window {obs.duration_s:.1f} s: {len(obs.steps)} steps, {len(obs.requests)} requests finished, "
        f"{obs.arrival_rate:.2f} req/s arrived, {obs.output_throughput:.1f} output tok/s, device busy "
        f"{100 * obs.busy_share:.0f}%",
    ]
    if obs.requests:
        ms = {name: [1000 * (obs.latency(name, p) or 0.0) for p in (50, 99)] for name in ("ttft_s", "e2e_s")}
        lines.append(
            f"TTFT p50/p99 {ms['ttft_s'][0]:.0f}/{ms['ttft_s'][1]:.0f} ms, e2e p50/p99 {ms['e2e_s'][0]:.0f}/"
            f"{ms['e2e_s'][1]:.0f} ms, prompt p50/p99 {obs.prompt_len(50):.0f}/{obs.prompt_len(99):.0f} tokens"
        )
    if not diagnosis.findings:
        lines.append("no problem found")
    for i, f in enumerate(diagnosis.findings, 1):
        lines += ["", f"{i}. {f.symptom}  [{f.rule}]"]
        lines += [f"   evidence: {e}" for e in f.evidence]
        lines.append(f"   change:   {f.change}")
        if f.prediction is not None:
            lines.append(f"   effect:   {f.prediction.describe()}")
    lines += [f"note: {n}" for n in diagnosis.notes]
    return "\n".join(lines)


def as_json(obs: Observation, diagnosis: Diagnosis) -> dict[str, Any]:
    return {
        "window_s": obs.duration_s,
        "findings": [f.to_dict() for f in diagnosis.findings],
        "notes": diagnosis.notes,
    }


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if bool(args.url) == bool(args.trace):
        parser.error("give --url of a running server or a bench trace file")
    try:
        obs = observe(args)
    except SourceError as exc:
        print(f"batchserve doctor: {exc}", file=sys.stderr)
        return 1
    model = Profile.load(args.profile).step_model if args.profile else None
    diagnosis = diagnose(obs, model, simulate=not args.no_simulate)
    print(json.dumps(as_json(obs, diagnosis), indent=2) if args.json else render(obs, diagnosis))
    return 0


if __name__ == "__main__":
    sys.exit(main())
