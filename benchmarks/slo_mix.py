"""Short questions beside document summaries: FCFS against the SLO policy, on the same trace.

The mix: short Q&A (50 prompt / 100 output tokens) and summaries (2,000 / 500), max_batch_size 32, max_num_tokens
8192, Poisson arrivals. Targets: --short-ttft-ms 500, --short-tpot-ms 250 (a full batch's decode step on a 2-core CPU
takes 60-140 ms, so GPU serving's 100 ms is out of reach), --long-ttft-ms 10000, --long-tpot-ms 250. The request rate
is the lowest of --rates at which FCFS misses the short requests' TTFT target for more than 30% of them (or --rate).
Each policy runs once on the same trace; a refused request counts as a miss.

    .venv/bin/python benchmarks/slo_mix.py --profile benchmarks/profiles/smollm2-bf16-1thread-xeon-amx-2cpu-v2.json
    .venv/bin/python benchmarks/slo_mix.py --profile P --requests 40 --policies fcfs,slo --engine --calibrate
    .venv/bin/python benchmarks/slo_mix.py --profile P --requests 40 --policies fcfs --vllm
    bash benchmarks/slo_mix_full.sh                          # everything at 200 requests, for a quiet host

--engine: the real engine (default model, the profile's dtype, --threads 1) on the same trace, every policy, with
the simulator's goodput error per policy and the run's steps against the profile by kind. --vllm: the trace through
vLLM's CPU build (slo_mix_vllm.py, in vLLM's venv). --cpu-clock: both timed on their thread's CPU time (a busy host).

Policies: fcfs (the defaults), isolate (long_prefill_token_threshold, max_long_partial_prefills 1), slo (isolate plus
slo_admission refuse, with its default slot reserve, and max_preemptions_per_request 2), slo-demote (isolate plus
slo_admission deprioritize). --explain: where the short requests waited (simulated); each table ends with the goodput
ceiling (every request within its targets over FCFS's run), which no policy can pass.
Prints goodput (requests within their targets per second), the short requests' TTFT p99 and miss rate, and the long
requests' output throughput; ratios against fcfs.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from batchserve.bench.arrivals import ArrivalProcess
from batchserve.bench.metrics import RequestResult
from batchserve.bench.workloads import BenchRequest, WorkloadOptions, make_workload
from batchserve.config import EngineConfig
from batchserve.simulator.build import make_cluster
from batchserve.simulator.profile_file import Profile
from batchserve.simulator.shape import StepShape
from batchserve.simulator.step_model import ScaledStepModel
from batchserve.simulator.tokens import workload_tokenizer

MIX = {"max_batch_size": 32, "max_num_tokens": 8192}


def policies(threshold: int) -> dict[str, dict]:
    isolate = {"long_prefill_token_threshold": threshold, "max_long_partial_prefills": 1}
    return {
        "fcfs": {},
        "isolate": isolate,
        "slo": isolate | {"slo_admission": "refuse", "max_preemptions_per_request": 2},
        "slo-demote": isolate | {"slo_admission": "deprioritize", "max_preemptions_per_request": 2},
    }


POLICIES = policies(128)


def targets(requests: list[BenchRequest], args: argparse.Namespace) -> list[BenchRequest]:
    short = {"ttft_slo_ms": args.short_ttft_ms, "tpot_slo_ms": args.short_tpot_ms}
    long = {"ttft_slo_ms": args.long_ttft_ms, "tpot_slo_ms": args.long_tpot_ms}
    return [replace(r, **(long if r.category == "long" else short)) for r in requests]


def make_requests(args: argparse.Namespace, num_requests: int, seed: int) -> list[BenchRequest]:
    options = WorkloadOptions(long_ratio=args.long_ratio, long_output_len=args.long_output_len)
    return targets(make_workload("mixed", workload_tokenizer(None, None), num_requests, seed, options), args)


def met(result: RequestResult, request: BenchRequest) -> bool:
    if not result.success or result.ttft is None or result.ttft * 1000 > request.ttft_slo_ms:
        return False
    return result.tpot is None or result.tpot * 1000 <= request.tpot_slo_ms


def summary(results: list[RequestResult], duration_s: float, requests: list[BenchRequest]) -> dict[str, float]:
    by_id = {r.request_id: r for r in requests}
    shorts = [r for r in results if r.category == "short"]
    served_short = [r.ttft for r in shorts if r.success and r.ttft is not None]
    short_misses = sum(1 for r in shorts if not met(r, by_id[r.request_id]))
    ttft_misses = sum(1 for r in shorts if not (r.success and r.ttft is not None
                                                 and r.ttft * 1000 <= by_id[r.request_id].ttft_slo_ms))  # fmt: skip
    longs = [r for r in results if r.category == "long"]
    return {
        "goodput": sum(met(r, by_id[r.request_id]) for r in results) / duration_s,
        "attainment": sum(met(r, by_id[r.request_id]) for r in results) / len(results),
        "short_ttft_p99_ms": 1000 * float(np.percentile(served_short, 99)) if served_short else math.nan,
        "short_ttft_miss": ttft_misses / max(1, len(shorts)),
        "short_slo_miss": short_misses / max(1, len(shorts)),
        "long_tok_s": sum(r.output_len for r in longs if r.success) / duration_s,
        "refused": sum(1 for r in results if not r.success),
        "duration_s": duration_s,
    }


def simulate(policy: str, profile: Profile, requests, rate: float, seed: int) -> dict[str, float]:
    config = EngineConfig.from_options(**MIX, **POLICIES[policy], enable_chunked_prefill=True)
    trace = make_cluster(config, profile).run(requests, ArrivalProcess(request_rate=rate), seed=seed).trace
    return summary(trace.requests, trace.meta["duration_s"], requests)


def short_waits(policy: str, profile: Profile, requests, rate: float, seed: int) -> dict[str, float]:
    """Where the short requests wait for their first chunk, simulated: each step a short request spends queued is
    charged, by its length, to what held it back: every batch slot taken (`slots`), the step's token budget spent
    (`tokens`), or something else (KV blocks, the slot reserve, the prefill caps). Shares of the whole queued time
    (`seconds`), and the summaries' mean share of the batch in the `slots` steps."""
    config = EngineConfig.from_options(**MIX, **POLICIES[policy], enable_chunked_prefill=True)
    cluster = make_cluster(config, profile)
    engine = cluster.replicas[0].engine
    scheduler, short = engine.scheduler, {r.request_id for r in requests if r.category == "short"}
    counts, summaries, plain_step = {"slots": 0, "tokens": 0, "other": 0}, [], engine.step

    def step():
        queued, start = [r.request_id for r in scheduler.waiting if r.request_id in short], engine.clock()
        outputs = plain_step()
        batch = scheduler.last_step.output.num_scheduled_tokens
        left = [rid for rid in queued if rid not in batch]
        full = len(batch) >= scheduler.config.max_batch_size
        why = "slots" if full else "tokens" if scheduler.last_step.token_budget <= 0 else "other"
        counts[why] += len(left) * (engine.clock() - start)
        if full and left:
            summaries.append(sum(rid not in short for rid in batch) / len(batch))
        return outputs

    engine.step = step
    cluster.run(requests, ArrivalProcess(request_rate=rate), seed=seed)
    total = sum(counts.values())
    share = float(np.mean(summaries)) if summaries else 0.0
    return {k: v / (total or 1) for k, v in counts.items()} | {"seconds": total, "summaries_share": share}


class TimedSteps:
    """The engine with each step's shape (the profiler's recorder) and wall time noted, so that a run's steps can be
    set against the profile's prediction for the very same shapes."""

    def __init__(self, engine) -> None:
        from batchserve.simulator.profiler import ShapeRecorder

        self.engine, self.runner = engine, engine.runner
        self.recorder = engine.runner = ShapeRecorder(engine)
        self.steps: list[tuple[StepShape, float]] = []

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def step(self):
        self.recorder.last_shape = StepShape()
        start, cpu = time.perf_counter(), time.thread_time()
        outputs = self.engine.step()
        elapsed, cpu = time.perf_counter() - start, time.thread_time() - cpu
        if self.recorder.last_shape.seqs:
            self.steps.append((self.recorder.last_shape, elapsed, cpu))
        return outputs

    def close(self) -> None:
        self.engine.runner = self.runner

    def speed(self, profile: Profile, cpu: bool = False) -> dict[str, float]:
        """Measured / predicted step time, summed over the run's steps of each kind (decode, mixed, prefill), over
        those with prompt tokens (`prompt`: mixed and prefill) and over all of them (`all`). With `cpu`, the thread's CPU time instead of the wall time: with one torch thread
        the step's work runs on this thread, and its CPU time leaves out the time other processes held the core, so
        on a busy host it says whether the step model prices each kind right (near 1.00x in every kind) where the
        wall time cannot (the host's sharing or contention still inflates it some)."""
        sums: dict[str, list[float]] = {}
        for shape, wall, thread in self.steps:
            for kind in (shape.kind, "all", *(("prompt",) if shape.kind != "decode" else ())):
                pair = sums.setdefault(kind, [0.0, 0.0])
                pair[0], pair[1] = pair[0] + (thread if cpu else wall), pair[1] + profile.step_model.predict(shape)
        return {kind: measured / predicted for kind, (measured, predicted) in sums.items() if predicted > 0}


def at_speed(profile: Profile, decode: float, other: float) -> Profile:
    return replace(profile, step_model=ScaledStepModel(profile.step_model, other, decode))


def on_engine(names: list[str], requests, rate: float, profile: Profile, args: argparse.Namespace) -> dict:
    """The real engine (the default model, the profile's dtype, --threads torch threads) through bench's offline
    driver, on the same trace; one model load and warm-up, a fresh scheduler per policy. With --calibrate each policy's
    run is preceded by a speed check (batchserve profile --check) and simulated again at that minute's speed."""
    from slo_mix_vllm import CpuClock  # standard library only: the same clock vLLM's run is timed on

    from batchserve.bench.offline import build_engine, run_offline
    from batchserve.bench.warmup import warmup_requests
    from batchserve.host.process import configure_torch
    from batchserve.simulator.profiler import check_speed

    configure_torch(args.threads, args.seed)
    out: dict[str, dict] = {"engine": {}, "simulated_at_host_speed": {}, "host_speed": {}, "step_speed": {},
                            "simulated_at_run_speed": {}, "loadavg": {}, "step_cpu_speed": {},
                            "steps": {}}  # fmt: skip
    engine, clock = None, CpuClock() if args.cpu_clock else time.monotonic
    timing = {"clock": clock, "sleep": clock.sleep} if args.cpu_clock else {}
    for name in names:
        config = EngineConfig.from_options(**MIX, **POLICIES[name], num_kv_blocks=args.num_kv_blocks,
                                           dtype=profile.dtype, num_threads=args.threads)  # fmt: skip
        fresh = engine is None
        engine = build_engine(config, like=engine, clock=clock)
        if fresh:  # the first forward of each shape, the largest prefill, a full batch's decode: not timed
            warm = warmup_requests(lambda n, seed: make_requests(args, n, seed), MIX["max_batch_size"])
            run_offline(engine, warm, progress=False, label="warmup", **timing)
        if args.calibrate:
            check = check_speed(engine, profile, args.seed, time.thread_time if args.cpu_clock else time.perf_counter)
            out["host_speed"][name] = {"time_scale": check.factor, "decode_time_scale": check.decode_factor}
            scaled = at_speed(profile, check.decode_factor, check.factor)
            out["simulated_at_host_speed"][name] = simulate(name, scaled, requests, rate, args.seed)
        timed, load = TimedSteps(engine), os.getloadavg()[0]
        trace = run_offline(timed, requests, ArrivalProcess(request_rate=rate), args.seed, name, False, **timing)
        timed.close()
        out["loadavg"][name] = [load, os.getloadavg()[0]]  # 1-minute, at the run's start and end
        out["engine"][name] = summary(trace.requests, trace.meta["duration_s"], requests)
        out["step_speed"][name] = timed.speed(profile)
        out["step_cpu_speed"][name] = timed.speed(profile, cpu=True)
        out["steps"][name] = [shape.to_dict() | {"wall_s": round(wall, 6), "cpu_s": round(cpu, 6), "predicted_s":
                               round(profile.step_model.predict(shape), 6)} for shape, wall, cpu in timed.steps]  # fmt: skip
        speed = out["step_cpu_speed" if args.cpu_clock else "step_speed"][name]  # the speed on the run's clock
        # decodes (memory-bound: they slow with the host's memory traffic) and steps with prompt tokens (compute-bound)
        # each at their own speed: one factor for all would scale the prompt steps by the decodes' slowdown
        scaled = at_speed(profile, speed.get("decode", 1.0), speed.get("prompt", speed.get("all", 1.0)))
        out["simulated_at_run_speed"][name] = simulate(name, scaled, requests, rate, args.seed)
    return out


def on_vllm(requests, rate: float, args: argparse.Namespace) -> tuple[dict, dict]:
    """The same trace through vLLM's CPU build (benchmarks/slo_mix_vllm.py in vLLM's venv): its summary row and
    the settings it ran with."""
    import slo_mix_vllm

    from batchserve import env

    offsets = ArrivalProcess(request_rate=rate).offsets(len(requests), args.seed)
    trace = [{"request_id": r.request_id, "category": r.category, "prompt_token_ids": r.prompt_token_ids,
              "max_tokens": r.output_len, "arrival_s": t} for r, t in zip(requests, offsets, strict=True)]  # fmt: skip
    options = slo_mix_vllm.BEST | json.loads(args.vllm_options)
    priorities = {"short": 0, "long": 1} if options.get("scheduling_policy") == "priority" else {}
    out = slo_mix_vllm.run(trace, Path(args.hf_dir or env.hf_export_dir()).resolve(),
                           Path(args.vllm_python or env.vllm_python()).absolute(), options, priorities, args.threads,
                           Path(env.BENCH_RESULTS) / "slo_mix_vllm.log", args.vllm_timeout, args.cpu_clock)  # fmt: skip
    keys = ("version", "options", "load_s", "warmup_s", "loadavg", "cpu_s")
    settings = {k: out[k] for k in keys} | {"priorities": priorities, "cpu_clock": args.cpu_clock}
    return summary(*vllm_results(out["results"], requests), requests=requests), settings


def vllm_results(records: list[dict], requests: list[BenchRequest]) -> tuple[list[RequestResult], float]:
    """The worker's per-request times (seconds after its start) as bench's results, and the run's duration (its
    last finish)."""
    category = {r.request_id: r.category for r in requests}
    results = [RequestResult(rec["request_id"], 0, rec["output_len"], rec["arrival_s"], rec["first_token_s"],
                             rec["finish_s"], category=category[rec["request_id"]]) for rec in records]  # fmt: skip
    return results, max(rec["finish_s"] for rec in records)


def accuracy(simulated: dict, out: dict) -> str:
    """Per policy: the engine's goodput, the simulator's at the profile's speed, at the run's own step speed and (with
    --calibrate) at the speed checked before the run, each with its error; and the run's steps against the profile."""
    columns = [("simulated", simulated), ("at run speed", out["simulated_at_run_speed"]),
               ("at checked speed", out["simulated_at_host_speed"])]  # fmt: skip
    columns = [(label, rows) for label, rows in columns if rows]
    lines = [f"{'policy':<11} {'engine':>8} " + " ".join(f"{label:>16} {'error':>7}" for label, _ in columns)
             + "   engine steps / profile (decode, mixed, prefill, all): wall | thread CPU time"]  # fmt: skip
    for name, e in out["engine"].items():
        cells = [
            f"{rows[name]['goodput']:>16.3f} {relative(rows[name]['goodput'], e['goodput'])}" for _, rows in columns
        ]
        kinds = [", ".join(f"{speed[k]:.2f}x" if k in speed else "-" for k in ("decode", "mixed", "prefill", "all"))
                 for speed in (out["step_speed"][name], out["step_cpu_speed"][name])]  # fmt: skip
        lines.append(f"{name:<11} {e['goodput']:>8.3f} " + " ".join(cells) + f"   {kinds[0]} | {kinds[1]}")
    return "\n".join(lines)


def ceiling(rows: dict[str, dict[str, float]], num_requests: int) -> str:
    """Goodput is bounded by every request within its targets over the run's length, so no policy can beat FCFS by
    more than about 1 / FCFS's attainment on the same trace."""
    base = rows["fcfs"]
    best = num_requests / base["duration_s"]
    return (f"ceiling: all {num_requests} within their targets over FCFS's {base['duration_s']:.0f} s = {best:.3f} "
            f"req/s, {best / base['goodput']:.2f}x FCFS")  # fmt: skip


def relative(predicted: float, measured: float) -> str:
    return f"{100 * (predicted - measured) / measured:>+6.1f}%" if measured else f"{'-':>7}"


def ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b and not math.isnan(a / b) else "-"


def table(rows: dict[str, dict[str, float]]) -> str:
    base = rows["fcfs"]
    lines = [f"{'policy':<11} {'goodput':>8} {'x fcfs':>6} {'SLO %':>6} {'short TTFT p99 ms':>17} {'better':>6} "
             f"{'short TTFT miss':>15} {'long tok/s':>10} {'x fcfs':>6} {'refused':>7}"]  # fmt: skip
    for name, s in rows.items():
        lines.append(
            f"{name:<11} {s['goodput']:>8.3f} {ratio(s['goodput'], base['goodput']):>6} {100 * s['attainment']:>6.1f} "
            f"{s['short_ttft_p99_ms']:>17.0f} {ratio(base['short_ttft_p99_ms'], s['short_ttft_p99_ms']):>6} "
            f"{100 * s['short_ttft_miss']:>14.1f}% {s['long_tok_s']:>10.1f} "
            f"{ratio(s['long_tok_s'], base['long_tok_s']):>6} {s['refused']:>7}"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True)
    p.add_argument("--requests", "--num-requests", dest="num_requests", type=int, default=200)
    p.add_argument("--long-ratio", type=float, default=0.2)
    p.add_argument("--long-output-len", type=int, default=500)
    p.add_argument("--rate", type=float, default=None, help="requests/s (default: searched over --rates)")
    p.add_argument("--rates", default="0.5,0.6,0.7,0.8,0.85,0.9,1,1.2,1.5,2,3,4")
    p.add_argument("--short-ttft-ms", type=float, default=500.0)
    p.add_argument("--short-tpot-ms", type=float, default=250.0)
    p.add_argument("--long-ttft-ms", type=float, default=10_000.0)
    p.add_argument("--long-tpot-ms", type=float, default=250.0)
    p.add_argument("--threshold", type=int, default=128, help="long_prefill_token_threshold of the SLO policies")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--policies", default=",".join(POLICIES), help="the policies run (default: all)")
    p.add_argument("--explain", action="store_true", help="also say where the short requests waited (simulated)")
    p.add_argument("--engine", action="store_true", help="also run the real engine (default model) on the trace")
    p.add_argument("--threads", type=int, default=1, help="torch threads of the engine, OpenMP threads of vLLM "
                   "(default 1: the profile's)")  # fmt: skip
    p.add_argument("--calibrate", action="store_true", help="--engine: time a few steps before each policy's run "
                   "(batchserve profile --check) and simulate again at that minute's speed")  # fmt: skip
    p.add_argument("--cpu-clock", action="store_true", help="time the engine (its scheduler, the requests' TTFT / "
                   "TPOT) and vLLM's run on their thread's CPU time, not the wall clock: a busy host's figures as on a "
                   "quiet one (with --threads 1 only)")  # fmt: skip
    p.add_argument("--num-kv-blocks", type=int, default=None, help="the real engine's KV pool (--engine)")
    p.add_argument("--vllm", action="store_true", help="also run the trace through vLLM's CPU build (its venv)")
    p.add_argument("--vllm-python", default=None, help="vLLM's interpreter (default: $VLLM_PYTHON, else "
                   "bench_results/vllm-venv/bin/python)")  # fmt: skip
    p.add_argument("--hf-dir", default=None, help="the model exported for vLLM (benchmarks/export_hf.py)")
    p.add_argument("--vllm-options", default="{}", help="JSON of vLLM EngineArgs keywords over slo_mix_vllm.BEST")
    p.add_argument("--vllm-timeout", type=float, default=3600.0)
    p.add_argument("--json", default=None, help="write the rows here")
    return p.parse_args(argv)


def find_rate(args: argparse.Namespace, profile: Profile, requests: list[BenchRequest]) -> float:
    """--rate, else the lowest of --rates at which FCFS misses the short TTFT target for more than 30% of them."""
    if args.rate is not None:
        return args.rate
    for candidate in (float(r) for r in args.rates.split(",")):
        if simulate("fcfs", profile, requests, candidate, args.seed)["short_ttft_miss"] > 0.3:
            return candidate
    raise SystemExit("FCFS met the short TTFT target at every rate tried: raise --rates")


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    POLICIES.update(policies(args.threshold))
    names = [n.strip() for n in args.policies.split(",") if n.strip()]
    unknown = sorted(set(names) - set(POLICIES))
    if unknown or "fcfs" not in names:
        raise SystemExit(f"--policies: {unknown or 'fcfs is needed (the ratios are against it)'}; "
                         f"choose from {', '.join(POLICIES)}")  # fmt: skip
    if args.cpu_clock and args.threads != 1:
        raise SystemExit("--cpu-clock needs --threads 1 (a step's work on the engine's own thread)")
    profile = Profile.load(args.profile)
    requests = make_requests(args, args.num_requests, args.seed)
    rate = find_rate(args, profile, requests)
    print(f"mixed: {args.num_requests} requests ({100 * args.long_ratio:g}% summaries), Poisson {rate:g} req/s, "
          f"seed {args.seed}; profile {profile.label}; {MIX}")  # fmt: skip
    start = time.monotonic()
    rows = {name: simulate(name, profile, requests, rate, args.seed) for name in names}
    print(f"\nsimulated ({time.monotonic() - start:.1f} s)\n{table(rows)}", flush=True)
    print(ceiling(rows, args.num_requests))
    if args.explain:
        print("\nwhere the short requests waited for their first chunk, simulated (shares of their queued time)")
        for name in names:
            w = short_waits(name, profile, requests, rate, args.seed)
            print(f"{name:<11} {w['seconds']:>7.1f} s: all {MIX['max_batch_size']} slots taken {100 * w['slots']:5.1f}% "
                  f"(summaries {100 * w['summaries_share']:.0f}% of them), token budget spent {100 * w['tokens']:5.1f}%, "
                  f"other {100 * w['other']:5.1f}%")  # fmt: skip
    out = {"rate": rate, "num_requests": args.num_requests, "threads": args.threads, "cpu_clock": args.cpu_clock,
           "simulated": rows}  # fmt: skip
    if args.engine:
        start = time.monotonic()
        out |= on_engine(names, requests, rate, profile, args)
        clock = "thread CPU time" if args.cpu_clock else "wall clock"
        print(f"\nengine, {args.threads} thread(s), {clock} ({time.monotonic() - start:.1f} s)\n{table(out['engine'])}")
        save(out, args.json)
        print(f"\ngoodput (req/s), simulated against the engine\n{accuracy(rows, out)}", flush=True)
        for name, (first, last) in out["loadavg"].items():
            speed = out["host_speed"].get(name)
            checked = (f"; checked before: {speed['time_scale']:.3f}x the profile's step times, "
                       f"{speed['decode_time_scale']:.3f}x its decodes") if speed else ""  # fmt: skip
            print(f"  {name}: load average {first:.2f} -> {last:.2f}{checked}")
    if args.vllm:
        start = time.monotonic()
        row, out["vllm_settings"] = on_vllm(requests, rate, args)
        out["vllm"] = row
        source = "engine" if "engine" in out else "simulated"
        both = {**out.get("engine", rows), "vllm": row}
        v = out["vllm_settings"]
        print(f"\nvLLM {v['version']} ({time.monotonic() - start:.1f} s; load {v['load_s']:.0f} s, warm-up "
              f"{v['warmup_s']:.0f} s, load average {v['loadavg'][0]:.2f} -> {v['loadavg'][1]:.2f}; CPU time of the run "
              f"{v['cpu_s']['thread']:.0f} s on its thread, {v['cpu_s']['process']:.0f} s in all), "
              f"{json.dumps(v['options'])}; beside the {source} rows\n{table(both)}")  # fmt: skip
    save(out, args.json)


def save(out: dict, path: str | None) -> None:
    if path:
        Path(path).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))  # slo_mix_vllm, peer_compare
    main()
