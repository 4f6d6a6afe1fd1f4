"""Short questions beside document summaries: FCFS against the SLO policy, on the same trace.

The mix: short Q&A (50 prompt / 100 output tokens) and summaries (2,000 / 500), max_batch_size 32, max_num_tokens
8192, Poisson arrivals. Targets: --short-ttft-ms 500, --short-tpot-ms 250 (a full batch's decode step on a 2-core CPU
takes 60-140 ms, so GPU serving's 100 ms is out of reach), --long-ttft-ms 10000, --long-tpot-ms 250. The request rate
is the lowest of --rates at which FCFS misses the short requests' TTFT target for more than 30% of them (or --rate).
Each policy runs once on the same trace; a refused request counts as a miss.

    .venv/bin/python benchmarks/slo_mix.py --profile benchmarks/profiles/smollm2-bf16-1thread-xeon-amx-2cpu-v2.json
    .venv/bin/python benchmarks/slo_mix.py --profile P --rate 3 --engine   # the real engine too (minutes)

Policies: fcfs (the defaults), isolate (long_prefill_token_threshold, max_long_partial_prefills 1), slo (isolate plus
slo_admission refuse and max_preemptions_per_request 2), slo-demote (isolate plus slo_admission deprioritize).
Prints goodput (requests within their targets per second), the short requests' TTFT p99 and miss rate, and the long
requests' output throughput; ratios against fcfs.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import replace

import numpy as np

from batchserve.bench.arrivals import ArrivalProcess
from batchserve.bench.metrics import RequestResult
from batchserve.bench.workloads import BenchRequest, WorkloadOptions, make_workload
from batchserve.config import EngineConfig
from batchserve.simulator.build import make_cluster
from batchserve.simulator.profile_file import Profile
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


def met(result: RequestResult, request: BenchRequest) -> bool:
    if not result.success or result.ttft is None or result.ttft * 1000 > request.ttft_slo_ms:
        return False
    return result.tpot is None or result.tpot * 1000 <= request.tpot_slo_ms


def summary(results: list[RequestResult], requests: list[BenchRequest], duration_s: float) -> dict[str, float]:
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
    return summary(trace.requests, requests, trace.meta["duration_s"])


def on_engine(names: list[str], requests, rate: float, seed: int, args: argparse.Namespace) -> dict[str, dict]:
    """The real engine (the default model) through bench's offline driver, on the same trace; one model load, a
    fresh scheduler per policy."""
    from batchserve.bench.offline import build_engine, run_offline

    rows, engine = {}, None
    for name in names:
        config = EngineConfig.from_options(**MIX, **POLICIES[name], num_kv_blocks=args.num_kv_blocks)
        engine = build_engine(config, like=engine)
        trace = run_offline(engine, requests, ArrivalProcess(request_rate=rate), seed, name, False)
        rows[name] = summary(trace.requests, requests, trace.meta["duration_s"])
    return rows


def table(rows: dict[str, dict[str, float]]) -> str:
    base = rows["fcfs"]
    lines = [f"{'policy':<11} {'goodput':>8} {'x fcfs':>6} {'SLO %':>6} {'short TTFT p99 ms':>17} {'better':>6} "
             f"{'short TTFT miss':>15} {'long tok/s':>10} {'x fcfs':>6} {'refused':>7}"]  # fmt: skip
    for name, s in rows.items():
        lines.append(
            f"{name:<11} {s['goodput']:>8.3f} {s['goodput'] / base['goodput']:>6.2f} {100 * s['attainment']:>6.1f} "
            f"{s['short_ttft_p99_ms']:>17.0f} {base['short_ttft_p99_ms'] / s['short_ttft_p99_ms']:>6.2f} "
            f"{100 * s['short_ttft_miss']:>14.1f}% {s['long_tok_s']:>10.1f} "
            f"{s['long_tok_s'] / base['long_tok_s']:>6.2f} {s['refused']:>7}"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", required=True)
    p.add_argument("--num-requests", type=int, default=300)
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
    p.add_argument("--engine", action="store_true", help="also run the real engine (default model) on the trace")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="the real engine's KV pool (--engine)")
    p.add_argument("--json", default=None, help="write the rows here")
    args = p.parse_args()
    POLICIES.update(policies(args.threshold))

    profile = Profile.load(args.profile)
    options = WorkloadOptions(long_ratio=args.long_ratio, long_output_len=args.long_output_len)
    requests = make_workload("mixed", workload_tokenizer(None, None), args.num_requests, args.seed, options)
    requests = targets(requests, args)
    rate = args.rate
    if rate is None:
        for candidate in (float(r) for r in args.rates.split(",")):
            if simulate("fcfs", profile, requests, candidate, args.seed)["short_ttft_miss"] > 0.3:
                rate = candidate
                break
        else:
            raise SystemExit("FCFS met the short TTFT target at every rate tried: raise --rates")
    print(f"mixed: {args.num_requests} requests ({100 * args.long_ratio:g}% summaries), Poisson {rate:g} req/s, "
          f"seed {args.seed}; profile {profile.label}; {MIX}")  # fmt: skip
    start = time.monotonic()
    rows = {name: simulate(name, profile, requests, rate, args.seed) for name in POLICIES}
    print(f"\nsimulated ({time.monotonic() - start:.1f} s)\n{table(rows)}")
    out = {"rate": rate, "simulated": rows}
    if args.engine:
        start = time.monotonic()
        real = on_engine(["fcfs", "slo"], requests, rate, args.seed, args)
        print(f"\nengine ({time.monotonic() - start:.1f} s)\n{table(real)}")
        out["engine"] = real
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
