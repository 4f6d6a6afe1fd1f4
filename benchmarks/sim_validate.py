"""The simulator against the real engine on this machine: predicted vs measured, side by side.

    .venv/bin/python benchmarks/sim_validate.py --profile bench_results/sim/profile.json
    .venv/bin/python benchmarks/sim_validate.py --profile P --workloads uniform --configs small --num-requests 40
    .venv/bin/python benchmarks/sim_validate.py --profile NEW.json --measured bench_results/sim-validation/validation.json

For each workload x configuration, the two request rates are set from the simulator's own estimate of the
configuration's capacity (all requests at once): --load-factors of it (default 0.35 and 0.7). Each point runs
`batchserve bench --offline` (the real engine, its warm-up, Poisson arrivals) and `batchserve simulate` with the same
flags and seed, then reads both summary.json files: the comparison is what any script can do with the two commands.
Targets: throughput and TTFT/TPOT p50 within 10%, p99 within 20%.

--calibrate: a shared or throttled host's speed drifts (10-30% between minutes were seen), and a profile predicts
the minute it was taken in. Before each real run the script times a few steps (`batchserve profile --check`) and
predicts at that minute's speed (`simulate --time-scale X --decode-time-scale Y`: decodes and prompts drift apart),
recording the prediction at the profile's speed beside it.

--measured FILE (a validation.json this script wrote) runs only the simulator, at that file's points and rates, and
compares with the real runs it recorded: a new profile or step model checked in seconds, without the real engine.
Each row records the flags its point ran with; files older than that get this command line's flags (pass the
--num-requests, --output-len, --seed and --engine-flags the measured run used).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from batchserve.bench.cli import main as bench_main
from batchserve.simulator.cli import main as simulate_main

CONFIGS = {
    "small": ["--max-batch-size", "8", "--max-num-tokens", "512"],
    "large": ["--max-batch-size", "32", "--max-num-tokens", "2048"],
}
METRICS = [  # (name, path in the summary, tolerance)
    ("out tok/s", ("output_throughput",), 0.10),
    ("TTFT p50", ("ttft_ms", "p50"), 0.10),
    ("TTFT p99", ("ttft_ms", "p99"), 0.20),
    ("TPOT p50", ("tpot_ms", "p50"), 0.10),
    ("TPOT p99", ("tpot_ms", "p99"), 0.20),
]


def summary(command, argv: list[str], out: Path) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    before = set(out.glob("*/summary.json"))
    if command(argv + ["--output-dir", str(out), "--no-plots", "--no-progress"]) != 0:
        raise RuntimeError(f"{argv} failed")
    (path,) = set(out.glob("*/summary.json")) - before
    runs = json.loads(path.read_text())["runs"]
    return next(iter(runs.values()))


def get(s: dict, path: tuple[str, ...]) -> float:
    for key in path:
        s = s[key]
    return float(s)


def point_argv(args: argparse.Namespace, workload: str, config: str) -> list[str]:
    """The flags both commands get for a workload x configuration (all requests at once: add --request-rate)."""
    return ["--workload", workload, "--num-requests", str(args.num_requests), "--output-len", str(args.output_len),
            "--seed", str(args.seed), *CONFIGS[config], *args.engine_flags.split()]  # fmt: skip


def predicted_row(args: argparse.Namespace, out: Path, row: dict) -> dict:
    """`row` (its point and measured numbers) with the simulator's prediction for the point; where the host's speed
    was checked before the point (--calibrate), `predicted` is at that speed and `predicted_raw` at the profile's."""
    argv = row.get("argv") or [*point_argv(args, row["workload"], row["config"]), "--request-rate", str(row["rate"])]
    point_dir = out / "sim" / f"{row['workload']}-{row['config']}-{row['rate']}"  # simulations take under a second

    def predict(scale: float, decode_scale: float) -> dict:  # a folder each: runs in one second share a timestamp
        where = point_dir / f"x{scale:g}-{decode_scale:g}"
        flags = ["--time-scale", str(scale), "--decode-time-scale", str(decode_scale)]
        s = summary(simulate_main, [*argv, "--profile", args.profile, *flags], where)
        return {m: get(s, path) for m, path, _ in METRICS}

    scale = row.get("time_scale", 1.0)
    decode_scale = row.get("decode_time_scale", scale)
    extra = {"predicted_raw": predict(1.0, 1.0)} if (scale, decode_scale) != (1.0, 1.0) else {}
    return {**row, "argv": argv, "predicted": predict(scale, decode_scale), **extra}


def host_speed(args: argparse.Namespace) -> dict:
    """The host's speed now against the profile's (batchserve profile --check): a few seconds of real steps."""
    import gc

    from batchserve.engine.llm_engine import LLMEngine
    from batchserve.entrypoints.engine_args import engine_config_from_args
    from batchserve.host.process import configure_torch
    from batchserve.simulator.profile_file import Profile
    from batchserve.simulator.profiler import build_parser, check_speed

    config = engine_config_from_args(build_parser().parse_args([*args.engine_flags.split(), "--num-kv-blocks", "256"]))
    configure_torch(config.num_threads, config.seed)
    engine = LLMEngine(config)
    result = check_speed(engine, Profile.load(args.profile), config.seed)
    del engine
    gc.collect()
    return {"time_scale": round(result.factor, 4), "decode_time_scale": round(result.decode_factor, 4)}


def measured_rows(args: argparse.Namespace, out: Path, done: set[tuple[str, str, float]]):
    """Each point's rate from the simulated capacity, and the real engine's run at that rate (but the `done` ones:
    (workload, config, load factor))."""
    for workload in args.workloads.split(","):
        for name in args.configs.split(","):
            base = point_argv(args, workload, name)
            cap = summary(simulate_main, [*base, "--profile", args.profile], out / "capacity")["request_throughput"]
            for factor in (float(f) for f in args.load_factors.split(",")):
                if (workload, name, factor) in done:
                    continue
                rate = round(cap * factor, 2)
                argv = [*base, "--request-rate", str(rate)]
                scale = host_speed(args) if args.calibrate else {}
                started = time.perf_counter()
                measured = summary(bench_main, [*argv, "--offline"], out / "real")
                yield {"workload": workload, "config": name, "rate": rate, "load": factor, "argv": argv,
                       "real_s": time.perf_counter() - started, **scale,
                       "measured": {m: get(measured, path) for m, path, _ in METRICS}}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True)
    p.add_argument("--measured", metavar="VALIDATION_JSON", help="simulate only: compare with these recorded real runs")
    p.add_argument("--workloads", default="uniform,longtail,shared-prefix")
    p.add_argument("--configs", default="small,large")
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--load-factors", default="0.35,0.7")
    p.add_argument("--out-dir", default="bench_results/sim-validation")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--engine-flags", default="", help="more flags for both commands, e.g. '--num-threads 1'")
    p.add_argument("--resume", action="store_true", help="keep the points OUT_DIR/validation.json has, run the rest")
    p.add_argument("--calibrate", action="store_true",
                   help="before each real run, time a few steps (batchserve profile --check) and predict at the "
                        "host's speed of that minute (--time-scale); both predictions are recorded")  # fmt: skip
    args = p.parse_args(argv)
    out = Path(args.out_dir)
    rows = json.loads((out / "validation.json").read_text()) if args.resume and not args.measured else []
    done = {(r["workload"], r["config"], r["load"]) for r in rows}
    points = json.loads(Path(args.measured).read_text()) if args.measured else measured_rows(args, out, done)
    for point in points:
        rows.append(predicted_row(args, out, point))
        print(format_row(rows[-1]), flush=True)
        (out / ("resimulated.json" if args.measured else "validation.json")).write_text(json.dumps(rows, indent=2))
    print("\n" + table(rows))
    if any("predicted_raw" in r for r in rows):
        print("\nAt the profile's speed (no --time-scale):\n" + table(rows, "predicted_raw"))
    return 0


def format_row(row: dict) -> str:
    cells = [f"{m} {row['measured'][m]:.1f}/{row['predicted'][m]:.1f}" for m, _, _ in METRICS]
    scale = (f", host at {row['time_scale']:.3f}x the profile's step times, {row.get('decode_time_scale', 1):.3f}x "
             "its decodes") if "time_scale" in row else ""  # fmt: skip
    point = f"{row['workload']} {row['config']} @ {row['rate']} req/s ({row['real_s']:.0f} s{scale})"
    return f"{point}: {', '.join(cells)}"


def table(rows: list[dict], predicted: str = "predicted") -> str:
    """Markdown: measured | predicted | error for each metric, a mark where the error is over its target."""
    scaled = predicted == "predicted" and any("time_scale" in r for r in rows)
    head = ("| workload | config | rate (req/s) | " + "time scale (steps / decodes) | " * scaled
            + " | ".join(f"{m} meas / pred (err)" for m, _, _ in METRICS) + " |")  # fmt: skip
    lines = [head, "|" + "---|" * (3 + scaled + len(METRICS))]
    within = total = 0
    for r in rows:
        steps = r.get("time_scale", 1.0)
        cells = [f"{steps:.3f} / {r.get('decode_time_scale', steps):.3f}"] * scaled
        for m, _, tol in METRICS:
            a, b = r["measured"][m], r[predicted][m]
            err = (b - a) / a if a else float("nan")
            ok = abs(err) <= tol
            within, total = within + ok, total + 1
            cells.append(f"{a:.1f} / {b:.1f} ({100 * err:+.0f}%{'' if ok else ' ✗'})")
        lines.append(f"| {r['workload']} | {r['config']} | {r['rate']:g} | " + " | ".join(cells) + " |")
    lines.append(f"\n{within} of {total} cells within target (p50 and throughput 10%, p99 20%; ✗ marks a miss)")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
