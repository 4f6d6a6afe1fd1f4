"""`batchserve tune`: sweep max_batch_size x max_num_tokens x scheduler_policy on a short offline run, keep the
configuration with the highest goodput among those meeting the SLO, write it as an engine config JSON file.

  batchserve tune --workload uniform --request-rate 2 --slo-ttft-ms 500 --slo-tpot-ms 100 --output tuned.json
  batchserve serve --config tuned.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from batchserve.bench import offline
from batchserve.bench.args import add_workload_arguments, arrivals_from_args, normalize, slo_from_args, workload_options
from batchserve.bench.metrics import summarize
from batchserve.bench.report import save_json
from batchserve.bench.warmup import warm_up
from batchserve.bench.workloads import make_workload
from batchserve.config import ALIASES, CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from batchserve.entrypoints.engine_args import ArgumentParser, add_engine_arguments, engine_config_from_args

SWEPT = ("scheduler_policy", "max_batch_size", "max_num_tokens")


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="batchserve tune", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--batch-sizes", default="8,16,32,64", help="max_batch_size values to try")
    p.add_argument("--num-tokens", default="512,1024,2048", help="max_num_tokens values to try")
    p.add_argument("--policies", default="max_utilization,guaranteed_no_evict", help="scheduler policies to try")
    p.add_argument("--min-attainment", type=float, default=0.9,
                   help="a configuration meets the SLO when at least this share of its requests do")  # fmt: skip
    p.add_argument("--output", default="tuned_config.json", help="the winning configuration (engine config JSON)")
    p.add_argument("--results-json", help="also save every configuration's summary here")
    p.add_argument("--simulate", action="store_true",
                   help="search on the simulator (needs --profile or --device-preset; see tune --simulate --help)")  # fmt: skip
    add_workload_arguments(p, slo_defaults=(500.0, 100.0))  # tuning needs a target
    add_engine_arguments(p)
    p.set_defaults(num_requests=32, request_rate=2.0)
    return p


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def explicit_options(args: argparse.Namespace) -> dict[str, Any]:
    """Engine options the user set (config file, then flags): what the written config keeps besides the winners."""
    out: dict[str, Any] = {}
    if getattr(args, "config", None):
        out.update(json.loads(Path(args.config).read_text()))
    names = {f.name for c in (EngineConfig, SchedulerConfig, CacheConfig) for f in dataclasses.fields(c)}
    out.update({n: getattr(args, n) for n in names - {"scheduler", "cache"} if getattr(args, n, None) is not None})
    return {ALIASES.get(k, k): v for k, v in out.items()}


def grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    return [
        {"scheduler_policy": p, "max_batch_size": b, "max_num_tokens": t}
        for p in policies
        for b in _ints(args.batch_sizes)
        for t in _ints(args.num_tokens)
    ]


def pick_best(rows: list[dict[str, Any]], min_attainment: float) -> tuple[dict[str, Any] | None, bool]:
    """Highest goodput (then output throughput) among rows meeting the SLO; else the best goodput, flagged."""
    key = lambda r: (r["summary"]["goodput"], r["summary"]["output_throughput"])  # noqa: E731
    feasible = [r for r in rows if r["summary"]["slo_attainment"] >= min_attainment]
    if feasible:
        return max(feasible, key=key), True
    return (max(rows, key=key), False) if rows else (None, False)


def format_rows(rows: list[dict[str, Any]], best: dict[str, Any] | None) -> str:
    head = f"{'policy':<20} {'batch':>5} {'tokens':>6} {'goodput':>8} {'SLO %':>6} {'out tok/s':>9} " \
           f"{'TTFT p99':>9} {'TPOT p99':>9} {'occup %':>7}"  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in sorted(rows, key=lambda r: -r["summary"]["goodput"]):
        s, c = r["summary"], r["config"]
        lines.append(
            f"{c['scheduler_policy']:<20} {c['max_batch_size']:>5} {c['max_num_tokens']:>6} {s['goodput']:>8.3f} "
            f"{100 * s['slo_attainment']:>6.1f} {s['output_throughput']:>9.1f} {s['ttft_ms']['p99']:>9.1f} "
            f"{s['tpot_ms']['p99']:>9.1f} {100 * s.get('batch_occupancy', float('nan')):>7.1f}"
            + ("   <- best" if r is best else "")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    from batchserve.host.process import configure_torch

    args = build_parser().parse_args(argv)
    if args.simulate:  # the CLI sends `tune --simulate` to the simulator's search (simulator/tune_sim.py), not here
        print("error: --simulate is the simulator's search: run `batchserve tune --simulate`", file=sys.stderr)
        return 2
    try:
        normalize(args)
        base = engine_config_from_args(args)
        explicit = explicit_options(args)
        slo, arrivals = slo_from_args(args), arrivals_from_args(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_torch(base.num_threads, base.seed)  # once for the process: the sweep's engines share it
    rows: list[dict[str, Any]] = []
    engine, requests = None, None
    for options in grid(args):
        try:
            config = EngineConfig.from_options(**{**base.to_flat_dict(), **options})
        except ConfigError as exc:
            print(f"skip {options}: {exc}", file=sys.stderr)
            continue
        engine = offline.build_engine(config, like=engine)
        if requests is None:
            requests = make_workload(args.workload, engine.tokenizer, args.num_requests, args.seed or 0,
                                     workload_options(args))  # fmt: skip
            report = warm_up(engine, args)
            if report is not None:
                print(report.describe())
        label = "{scheduler_policy} bs={max_batch_size} tok={max_num_tokens}".format(**options)
        trace = offline.run_offline(engine, requests, arrivals, args.seed or 0, label, not args.no_progress)
        rows.append({"config": options, "summary": summarize(trace.requests, trace.meta["duration_s"], slo,
                                                             trace.steps)})  # fmt: skip
    best, meets = pick_best(rows, args.min_attainment)
    print(f"{args.workload}: {args.num_requests} requests, {arrivals.describe()}; SLO TTFT <= {args.slo_ttft_ms:g} ms, "
          f"TPOT <= {args.slo_tpot_ms:g} ms for >= {100 * args.min_attainment:g}% of requests")  # fmt: skip
    print(format_rows(rows, best))
    if args.results_json:
        save_json({"rows": rows, "best": best, "meets_slo": meets}, args.results_json)
    if best is None:
        print("no configuration could run", file=sys.stderr)
        return 1
    chosen = {**explicit, **best["config"]}
    EngineConfig.from_options(**chosen)  # what we write must load
    Path(args.output).write_text(json.dumps(chosen, indent=2) + "\n")
    verdict = "meets the SLO" if meets else "NO configuration met the SLO; this one has the highest goodput"
    print(f"\nbest: {best['config']} ({verdict}); wrote {args.output}")
    return 0 if meets else 3


if __name__ == "__main__":
    sys.exit(main())
