"""`batchserve tune --simulate`: search the knobs on the simulator (seconds, not minutes a point), against the SLO;
optionally confirm the best few on the real engine (`--confirm N`).

  batchserve tune --simulate --profile prof.json --workload longtail --request-rate 4 --slo-ttft-ms 500
  batchserve tune --simulate --profile prof.json --workload mixed --request-rate 1 --slo ttft=500,tpot=250 \
      --prefill-thresholds 0,128,512 --slo-admissions off,refuse
  batchserve tune --simulate --device-preset h100-sxm --model-shapes llama-3-8b --request-rate 100 \\
      --replicas-list 1,2,4,8 --num-requests 2000
  batchserve tune --simulate --profile prof.json --workload shared-prefix --num-prefixes 64 \\
      --kv-offload-blocks 0,2000,20000

`--kv-offload-blocks` sizes the disk KV tier (simulator/kv_tier.py: LRU, reads charged to the step that loads them
at --kv-offload-read-gbps): each row reports the tier's hit rate, and the best size is printed as the
--kv-offload-max-bytes it takes (the tier is not written into the options file: it needs a directory).

Among configurations whose SLO attainment reaches --min-attainment the fewest replicas win, then the highest
goodput, then the highest output throughput; when none meets it, the highest goodput is reported and flagged.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path
from typing import Any

from batchserve.bench.args import arrivals_from_args, normalize, slo_from_args
from batchserve.bench.metrics import summarize
from batchserve.bench.report import save_json
from batchserve.bench.tune import build_parser as tune_parser
from batchserve.bench.tune import explicit_options
from batchserve.config import ConfigError, EngineConfig
from batchserve.entrypoints.engine_args import engine_config_from_args
from batchserve.simulator.build import make_cluster
from batchserve.simulator.cli import add_simulator_arguments, load_profile, lora_adapters
from batchserve.simulator.kv_tier import attach_sim_tier
from batchserve.simulator.tokens import workload_tokenizer

KNOBS = ("replicas", "scheduler_policy", "scheduling_order", "max_batch_size", "max_num_tokens", "block_size",
         "enable_chunked_prefill", "long_prefill_token_threshold", "slo_admission", "slo_reserved_slots",
         "kv_offload_blocks")  # fmt: skip
NOT_ENGINE_OPTIONS = ("replicas", "kv_offload_blocks")  # the cluster's size; the tier needs a directory as well


def build_parser() -> argparse.ArgumentParser:
    p = tune_parser()
    p.prog = "batchserve tune --simulate"
    g = p.add_argument_group("simulated search")
    g.add_argument("--orders", default="fcfs", help="scheduling orders to try (fcfs,priority,shortest_first)")
    g.add_argument("--block-sizes", default="16", help="block sizes to try")
    g.add_argument("--chunked", default="on", help="chunked prefill settings to try: on, off or on,off")
    g.add_argument("--replicas-list", default="1", help="replica counts to try")
    g.add_argument("--confirm", type=int, default=0, help="run the best N on the real engine and print both")
    g.add_argument("--slo", default=None, metavar="ttft=MS,tpot=MS",
                   help="the targets in one flag (= --slo-ttft-ms / --slo-tpot-ms); under an slo_admission other than "
                   "off they are also the engine's --ttft-slo-ms / --tpot-slo-ms")  # fmt: skip
    g.add_argument("--prefill-thresholds", default="0", help="long_prefill_token_threshold values to try (0: off; "
                   "above 0 with max_long_partial_prefills 1)")  # fmt: skip
    g.add_argument("--slo-admissions", default="off", help="slo_admission values to try (off,refuse,deprioritize)")
    g.add_argument("--slo-reserved-slots-list", default="auto", help="slo_reserved_slots values to try under an slo_admission "
                   "other than off (auto: the engine's default, a quarter of max_batch_size under refuse)")  # fmt: skip
    g.add_argument("--kv-offload-blocks", default="0", help="disk KV tier sizes to try, in blocks (0: no tier); "
                   "each row reports the tier's hit rate")  # fmt: skip
    g.add_argument(
        "--kv-offload-read-gbps",
        type=float,
        default=2.0,
        help="the tier's read rate in GB/s (a local NVMe SSD: 2), for the time a block takes to load",
    )
    add_simulator_arguments(p)
    p.set_defaults(num_requests=500)
    return p


def _list(text: str, kind: type = str) -> list[Any]:
    return [kind(x.strip()) for x in text.split(",") if x.strip()]


def grid(args: argparse.Namespace) -> list[dict[str, Any]]:
    chunked = [x == "on" for x in _list(args.chunked)]
    axes = (_list(args.replicas_list, int), _list(args.policies), _list(args.orders), _list(args.batch_sizes, int),
            _list(args.num_tokens, int), _list(args.block_sizes, int), chunked, _list(args.prefill_thresholds, int),
            _list(args.slo_admissions), _reserved_slots(args.slo_reserved_slots_list), _list(args.kv_offload_blocks, int))  # fmt: skip
    if any(n < 0 for n in axes[-1]):
        raise ValueError(f"--kv-offload-blocks: sizes must be >= 0 blocks, got {args.kv_offload_blocks!r}")
    if not args.kv_offload_read_gbps > 0:
        raise ValueError(f"--kv-offload-read-gbps must be > 0, got {args.kv_offload_read_gbps}")
    points = [dict(zip(KNOBS, values, strict=True)) for values in itertools.product(*axes)]
    # without SLO admission the workload's requests carry no target, so a kept slot would never be taken
    return [p for p in points if p["slo_admission"] != "off" or p["slo_reserved_slots"] is None]


def _reserved_slots(text: str) -> list[int | None]:
    values = [None if x == "auto" else x for x in _list(text)]
    try:
        values = [v if v is None else int(v) for v in values]
    except ValueError:
        raise ValueError(f"--slo-reserved-slots-list takes slot counts and auto, got {text!r}") from None
    if any(v is not None and v < 0 for v in values):
        raise ValueError(f"--slo-reserved-slots-list: counts must be >= 0, got {text!r}")
    return values


def parse_slo(args: argparse.Namespace) -> None:
    """--slo ttft=500,tpot=100 as --slo-ttft-ms / --slo-tpot-ms. Raises ValueError naming what is wrong."""
    if not args.slo:
        return
    names = {"ttft": "slo_ttft_ms", "tpot": "slo_tpot_ms"}
    for item in args.slo.split(","):
        key, _, value = item.strip().partition("=")
        if key not in names:
            raise ValueError(f"--slo takes ttft=MS and/or tpot=MS, not {item!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"--slo {item!r}: {value!r} is not a number of milliseconds") from None
        if not ms > 0:
            raise ValueError(f"--slo {item!r}: the target must be > 0 ms")
        setattr(args, names[key], ms)


def engine_options(knobs: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    """A grid point as engine options: a prefill threshold comes with one long prefill at a time, and SLO admission
    with the targets as the engine's defaults (the workload's requests carry none of their own)."""
    options = {k: v for k, v in knobs.items() if k not in NOT_ENGINE_OPTIONS}
    if options["slo_reserved_slots"] is None:
        del options["slo_reserved_slots"]
    if options["long_prefill_token_threshold"]:
        options["max_long_partial_prefills"] = 1
    if options["slo_admission"] != "off":
        options["ttft_slo_ms"], options["tpot_slo_ms"] = args.slo_ttft_ms, args.slo_tpot_ms
    return options


def pick(rows: list[dict[str, Any]], min_attainment: float) -> tuple[list[dict[str, Any]], bool]:
    """Every row, best first (those meeting the SLO ahead of the rest), and whether the first meets the SLO."""
    meets = [r["summary"]["slo_attainment"] >= min_attainment for r in rows]
    fewest = lambda r: (-r["config"]["replicas"], r["summary"]["goodput"], r["summary"]["output_throughput"])  # noqa: E731
    best = lambda r: (r["summary"]["goodput"], r["summary"]["output_throughput"])  # noqa: E731
    feasible = sorted((r for r, ok in zip(rows, meets, strict=True) if ok), key=fewest, reverse=True)
    rest = sorted((r for r, ok in zip(rows, meets, strict=True) if not ok), key=best, reverse=True)
    return feasible + rest, bool(feasible)


def format_rows(rows: list[dict[str, Any]], limit: int = 15) -> str:
    head = (f"{'rep':>3} {'policy':<20} {'order':<14} {'batch':>5} {'tokens':>6} {'block':>5} {'chunk':>5} "
            f"{'long>':>5} {'admission':<12} {'kept':>4} {'tier':>6} {'goodput':>8} {'SLO %':>6} {'out tok/s':>9} {'TTFT p50':>9} "
            f"{'TTFT p99':>9} {'TPOT p99':>9} {'tier hit %':>10}")  # fmt: skip
    lines = [head, "-" * len(head)]
    for r in rows[:limit]:
        c, s = r["config"], r["summary"]
        lines.append(
            f"{c['replicas']:>3} {c['scheduler_policy']:<20} {c['scheduling_order']:<14} {c['max_batch_size']:>5} "
            f"{c['max_num_tokens']:>6} {c['block_size']:>5} {'on' if c['enable_chunked_prefill'] else 'off':>5} "
            f"{c['long_prefill_token_threshold'] or '-':>5} {c['slo_admission']:<12} "
            f"{'auto' if c['slo_reserved_slots'] is None else c['slo_reserved_slots']:>4} {c['kv_offload_blocks'] or '-':>6} "
            f"{s['goodput']:>8.3f} {100 * s['slo_attainment']:>6.1f} {s['output_throughput']:>9.1f} "
            f"{s['ttft_ms']['p50']:>9.1f} {s['ttft_ms']['p99']:>9.1f} {s['tpot_ms']['p99']:>9.1f} "
            f"{100 * s['kv_tier']['hit_rate']:>10.1f}"
        )
    if len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more in --results-json")
    return "\n".join(lines)


def search(args: argparse.Namespace, base: EngineConfig, profile: Any, requests: list, arrivals: Any) -> list[dict]:
    slo = slo_from_args(args)
    rows = []
    for knobs in grid(args):
        options = engine_options(knobs, args)
        try:
            config = EngineConfig.from_options(**{**base.to_flat_dict(), **options})
        except ConfigError as exc:
            print(f"skip {knobs}: {exc}", file=sys.stderr)
            continue
        cluster = make_cluster(config, profile, knobs["replicas"], args.router, lora_adapters=lora_adapters(args))
        tiers = attach_tiers(cluster, knobs["kv_offload_blocks"], block_bytes(profile, config), args)
        t = cluster.run(requests, arrivals, args.seed or 0).trace
        summary = summarize(t.requests, t.meta["duration_s"], slo, t.steps)
        rows.append({"config": knobs, "summary": {**summary, "kv_tier": tier_summary(tiers, requests, config)}})
    return rows


def block_bytes(profile: Any, config: EngineConfig) -> int:
    return profile.kv_bytes_per_token * config.cache.block_size


def attach_tiers(cluster: Any, blocks: int, bytes_per_block: int, args: argparse.Namespace) -> list[Any]:
    """A simulated tier of `blocks` under each replica's pool (none for 0). Replicas on one host share the real
    tier's directory; here each has its own: a lower bound on the hits."""
    if blocks == 0:
        return []
    read_s = bytes_per_block / (args.kv_offload_read_gbps * 1e9)
    return [attach_sim_tier(r.engine.scheduler, blocks, read_s) for r in cluster.replicas]


def tier_summary(tiers: list[Any], requests: list, config: EngineConfig) -> dict[str, float]:
    """Blocks read back from the tier, and their share of the prompts' full blocks (the hit rate)."""
    hits = sum(t.stats.hits for t in tiers)
    full_blocks = sum(len(r.prompt_token_ids) // config.cache.block_size for r in requests)
    read_s = sum(t.stats.read_s for t in tiers)
    return {"hit_blocks": hits, "hit_rate": hits / full_blocks if full_blocks else 0.0, "read_s": read_s}


def confirm(args: argparse.Namespace, base: EngineConfig, rows: list[dict], arrivals: Any) -> None:
    """The best rows on the real engine (one replica's worth: replicas > 1 cannot run here)."""
    from batchserve.bench import offline
    from batchserve.bench.args import make_requests
    from batchserve.host.process import configure_torch

    configure_torch(base.num_threads, base.seed)
    slo, engine = slo_from_args(args), None
    print("\nconfirmed on the real engine (predicted -> measured):")
    for r in [r for r in rows if r["config"]["replicas"] == 1][: args.confirm]:
        options = engine_options(r["config"], args)
        engine = offline.build_engine(EngineConfig.from_options(**{**base.to_flat_dict(), **options}), like=engine)
        requests = make_requests(args, engine.tokenizer, args.num_requests, args.seed or 0)
        trace = offline.run_offline(engine, requests, arrivals, args.seed or 0, "confirm", not args.no_progress)
        real = summarize(trace.requests, trace.meta["duration_s"], slo, trace.steps)
        r["measured"] = real
        p = r["summary"]
        print(f"  {options}: goodput {p['goodput']:.3f} -> {real['goodput']:.3f}, out tok/s "
              f"{p['output_throughput']:.1f} -> {real['output_throughput']:.1f}, TTFT p99 {p['ttft_ms']['p99']:.0f} -> "
              f"{real['ttft_ms']['p99']:.0f} ms, TPOT p99 {p['tpot_ms']['p99']:.1f} -> {real['tpot_ms']['p99']:.1f} ms")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        parse_slo(args)
        normalize(args)
        base = engine_config_from_args(args)
        profile = load_profile(args, base)
        arrivals = arrivals_from_args(args)
        grid(args)  # its lists checked before any run
        from batchserve.bench.args import make_requests

        requests = make_requests(
            args, workload_tokenizer(args.model, args.tokenizer), args.num_requests, args.seed or 0
        )
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    wall = time.perf_counter()
    rows = search(args, base, profile, requests, arrivals)
    ranked, meets = pick(rows, args.min_attainment)
    print(f"profile: {profile.label}")
    print(f"{args.workload}: {args.num_requests} requests, {arrivals.describe()}; SLO TTFT <= {args.slo_ttft_ms:g} ms, "
          f"TPOT <= {args.slo_tpot_ms:g} ms for >= {100 * args.min_attainment:g}% of requests; {len(rows)} "
          f"configurations simulated in {time.perf_counter() - wall:.1f} s")  # fmt: skip
    print(format_rows(ranked))
    if not ranked:
        print("no configuration could run", file=sys.stderr)
        return 1
    if args.confirm:
        confirm(args, base, ranked, arrivals)
    if args.results_json:
        save_json({"rows": ranked, "meets_slo": meets, "profile": profile.label}, args.results_json)
    best = ranked[0]["config"]
    chosen = {**explicit_options(args), **engine_options(best, args)}
    EngineConfig.from_options(**chosen)  # what we write must load
    Path(args.output).write_text(json.dumps(chosen, indent=2) + "\n")
    verdict = "meets the SLO" if meets else "NO configuration met the SLO; this one has the highest goodput"
    print(f"\nbest: {best} ({verdict}); wrote {args.output} (replicas: {best['replicas']}, not an engine option)")
    if best["kv_offload_blocks"]:
        cap = best["kv_offload_blocks"] * block_bytes(profile, EngineConfig.from_options(**chosen))
        print(f"disk KV tier: {best['kv_offload_blocks']} blocks: --kv-offload-max-bytes {cap} with --kv-offload-dir")
    return 0 if meets else 3
