"""`batchserve simulate`: `bench`'s workload on the real scheduler and KV cache manager, in virtual time, with step
times from a profile (`batchserve profile`, or an analytic estimate for other hardware). Prints bench's table and
writes bench's summary.json, traces and pictures. Nothing runs a model.

  batchserve profile --output prof.json                       # once per machine, model, dtype, threads
  batchserve simulate --profile prof.json --workload longtail --num-requests 2000 --request-rate 8
  batchserve simulate --gpu h100-sxm --model-shapes llama-3-8b --replicas 8 --router prefix-aware \\
      --workload shared-prefix --num-requests 10000 --request-rate 200
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path
from typing import Any

from batchserve.bench.args import add_workload_arguments, arrivals_from_args, make_requests, normalize, slo_from_args
from batchserve.bench.cli import report
from batchserve.bench.outputs import run_label
from batchserve.bench.partial import ResultLog
from batchserve.bench.trace import RunTrace
from batchserve.config import EngineConfig
from batchserve.entrypoints.engine_args import ArgumentParser, add_engine_arguments, engine_config_from_args
from batchserve.simulator.analytic import DEVICES, MODEL_SHAPES, analytic_profile, resolve_shapes
from batchserve.simulator.build import make_cluster
from batchserve.simulator.layouts import Target, find_layout, host_memory
from batchserve.simulator.layouts import format_rows as format_layout_rows
from batchserve.simulator.lora_cost import ALL_TARGETS, LoRAShape, lora_step_model
from batchserve.simulator.parallel import Collective, ParallelStepModel, parallel_profile
from batchserve.simulator.profile_file import Profile
from batchserve.simulator.router import ROUTERS
from batchserve.simulator.step_model import ScaledStepModel
from batchserve.simulator.tokens import workload_tokenizer
from batchserve.simulator.trace_file import load_trace


def add_simulator_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("simulator")
    src = g.add_mutually_exclusive_group()
    src.add_argument("--profile", help="step-time profile JSON (batchserve profile --output FILE)")
    src.add_argument("--gpu", "--device-preset", dest="device_preset", choices=sorted(DEVICES),
                     help="an analytic (roofline) ESTIMATE for this device instead of a measured profile")  # fmt: skip
    g.add_argument("--model-shapes", default="smollm2-135m",
                   help=f"with --device-preset, --lora-rank, --tensor-parallel-size, --pipeline-parallel-size or --find-layout "
                        f"(whose collectives and memory need the shapes): a Llama-family config.json (file or "
                        f"directory), a .gguf file, or one of "
                        f"{', '.join(sorted(MODEL_SHAPES))} (default: smollm2-135m)")  # fmt: skip
    g.add_argument("--time-scale", type=float, default=1.0, metavar="X",
                   help="multiply every step time by X: 1.1 for a host running 10%% slower than when it was "
                        "profiled (batchserve profile --check PROFILE measures X), 0.5 for one twice as fast")  # fmt: skip
    g.add_argument("--decode-time-scale", type=float, metavar="Y",
                   help="multiply decode-only steps by Y instead (default: X); decodes stream memory and drift with "
                        "its load, prefills compute and drift less")  # fmt: skip
    g.add_argument("--replicas", type=int, default=1, help="engine replicas behind the router (default: 1)")
    g.add_argument("--router", choices=ROUTERS, default="round-robin", help="how requests pick a replica")
    g.add_argument("--spec-acceptance-rate", type=float, metavar="R",
                   help="with --speculative-config: the share of drafts the target keeps, as measured on the workload "
                   "(`batchserve bench` prints it); each decode then drafts k tokens")  # fmt: skip
    g.add_argument("--trace", help="arrivals and lengths from a JSONL file (arrival_s, input_len, output_len)")
    g.add_argument("--allreduce-bandwidth-gbs", type=float, default=10.0, metavar="GB_S",
                   help="with --tensor-parallel-size / --pipeline-parallel-size: bytes/s (in GB/s) one link between "
                        "ranks carries in a collective (default: 10, an assumption for ranks of one host)")  # fmt: skip
    g.add_argument(
        "--allreduce-latency-us",
        type=float,
        default=50.0,
        metavar="US",
        help="the fixed cost of each phase of a collective, microseconds (default: 50)",
    )
    g.add_argument("--host-memory-gib", type=float, metavar="GIB",
                   help="memory a host gives the model (weights and KV pool), shared by its ranks; a layout whose "
                        "weights do not fit is refused (default: the profile's machine's memory for each rank)")  # fmt: skip
    g.add_argument("--ranks-per-host", type=int, default=1, metavar="K", help="ranks one host runs (default: 1)")
    g.add_argument("--lora-rank", type=int, default=0, help="with --enable-lora: requests run with LoRA adapters of "
                   "this rank on the base of --model-shapes, each step paying their cost (simulator/lora_cost.py)")  # fmt: skip
    g.add_argument("--lora-adapters", type=int, default=8, help="with --lora-rank: distinct adapters, requests "
                   "spread over them in turn (default: 8)")  # fmt: skip
    g.add_argument("--lora-targets", default=",".join(ALL_TARGETS), help="with --lora-rank: the projections the "
                   "adapters target (default: all seven)")  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="batchserve simulate", description=__doc__,
                       formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--compare-static", action="store_true", help="also simulate static batching, side by side")
    p.add_argument("--sweep-rates", help="comma-separated request rates: one run each")
    p.add_argument("--output-dir", "--result-dir", dest="output_dir", default="bench_results",
                   help="summary JSON, traces and PNGs go here (default: bench_results)")  # fmt: skip
    p.add_argument("--save-result", action=argparse.BooleanOptionalAction, default=True, help="write the files")
    p.add_argument("--no-plots", action="store_true", help="no PNGs")
    p.add_argument("--timeline-steps", type=int, default=600, help="steps shown in the batch timeline")
    f = p.add_argument_group("how many hosts (--find-layout)")
    f.add_argument("--find-layout", action="store_true",
                   help="try tensor-parallel x pipeline x replica layouts from the fewest hosts up and report the "
                        "first whose weights fit --host-memory-gib and that meets the target at this load")  # fmt: skip
    f.add_argument("--max-hosts", type=int, default=8, help="the most hosts a layout may take (default: 8)")
    f.add_argument("--target-throughput", type=float, metavar="TOK_S", help="output tokens/s the layout must reach")
    f.add_argument(
        "--target-slo-attainment",
        type=float,
        metavar="F",
        help="share of requests within --slo-ttft-ms / --slo-tpot-ms the layout must reach (0.99)",
    )
    add_simulator_arguments(p)
    add_workload_arguments(p)
    add_engine_arguments(p)
    return p


def load_profile(args: argparse.Namespace, config: EngineConfig) -> Profile:
    if args.profile:
        profile = Profile.load(args.profile)
    elif args.device_preset:
        dtype = config.dtype if config.dtype != "auto" else "bfloat16"
        profile = analytic_profile(args.model_shapes, args.device_preset, dtype)
    else:
        raise ValueError("give --profile FILE (batchserve profile) or --device-preset NAME (an analytic estimate)")
    scale, decode = getattr(args, "time_scale", 1.0), getattr(args, "decode_time_scale", None)
    if not scale > 0 or (decode is not None and not decode > 0):
        raise ValueError(f"--time-scale and --decode-time-scale must be > 0 (got {scale}, {decode})")
    if scale != 1.0 or decode not in (None, scale):
        profile.step_model = ScaledStepModel(profile.step_model, scale, decode)
    if getattr(args, "lora_rank", 0):
        profile.step_model = lora_step_model(profile.step_model, resolve_shapes(args.model_shapes),
                                             lora_shape(args, config), profile.dtype)  # fmt: skip
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    split = tp * pp > 1 or getattr(args, "host_memory_gib", None) is not None
    if split and not getattr(args, "find_layout", False):  # --find-layout splits the single-rank profile itself
        per_host, rank_bytes = ranks_per_host(args), host_memory(args.host_memory_gib)
        rank_bytes = None if rank_bytes is None else rank_bytes / per_host
        profile = parallel_profile(profile, resolve_shapes(args.model_shapes), tp, pp, collective_from_args(args),
                                   rank_bytes, config.cache.kv_cache_memory_fraction)  # fmt: skip
    return profile


def collective_from_args(args: argparse.Namespace) -> Collective:
    if not args.allreduce_bandwidth_gbs > 0 or not args.allreduce_latency_us >= 0:
        raise ValueError(f"--allreduce-bandwidth-gbs must be > 0 and --allreduce-latency-us >= 0 (got "
                         f"{args.allreduce_bandwidth_gbs}, {args.allreduce_latency_us})")  # fmt: skip
    return Collective(args.allreduce_bandwidth_gbs * 1e9, args.allreduce_latency_us * 1e-6)


def ranks_per_host(args: argparse.Namespace) -> int:
    if args.ranks_per_host < 1:
        raise ValueError(f"--ranks-per-host must be >= 1 (got {args.ranks_per_host})")
    return args.ranks_per_host


def lora_shape(args: argparse.Namespace, config: EngineConfig) -> LoRAShape:
    """--lora-rank/--lora-targets checked against the engine's LoRA options. Raises ValueError naming the flag."""
    if not config.enable_lora:
        raise ValueError("--lora-rank needs --enable-lora (and --max-loras: adapters a step may run)")
    if not 0 < args.lora_rank <= config.max_lora_rank:
        raise ValueError(f"--lora-rank {args.lora_rank} must be 1 to --max-lora-rank ({config.max_lora_rank})")
    if args.lora_adapters < 1:
        raise ValueError(f"--lora-adapters must be >= 1, got {args.lora_adapters}")
    try:
        return LoRAShape(args.lora_rank, tuple(t.strip() for t in args.lora_targets.split(",") if t.strip()))
    except ValueError as exc:
        raise ValueError(f"--lora-targets: {exc}") from None


def lora_adapters(args: argparse.Namespace) -> int:
    return args.lora_adapters if getattr(args, "lora_rank", 0) else 0


def simulate_runs(args: argparse.Namespace, config: EngineConfig, profile: Profile, tokenizer: Any = None,
                  log: ResultLog | None = None) -> tuple[list, dict[str, RunTrace], list[tuple], dict[str, list]]:  # fmt: skip
    """Every (policy, rate) run as bench's run_offline_runs would do them (seed + k for the k-th rate)."""
    policies = ["static", "max_utilization"] if args.compare_static else [str(config.scheduler.scheduler_policy)]
    rates = [float(x) for x in args.sweep_rates.split(",") if x.strip()] if args.sweep_rates else [None]
    traces, keys, per_replica, first = {}, [], {}, []
    for k, rate in enumerate(rates):
        seed = (args.seed or 0) + k
        if args.trace:
            requests, arrivals = load_trace(args.trace, args.num_requests)
        else:
            requests, arrivals = make_requests(args, tokenizer, args.num_requests, seed), arrivals_from_args(args, rate)
        first = first or requests
        for policy in policies:
            cfg = dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, scheduler_policy=policy))
            cfg.validate()
            label = run_label(policy, rate)
            cluster = make_cluster(cfg, profile, args.replicas, args.router, args.spec_acceptance_rate,
                                   lora_adapters(args))  # fmt: skip
            result = cluster.run(requests, arrivals, seed, label)
            result.trace.meta.update(policy=policy, request_rate=getattr(arrivals, "request_rate", None), seed=seed,
                                     profile=profile.label, routed=result.routed, router=args.router)  # fmt: skip
            traces[label], per_replica[label] = result.trace, result.replicas
            keys.append((label, policy, rate))
            if log is not None:
                log.finish(label, result.trace)
    return first, traces, keys, per_replica


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        normalize(args)
        config = engine_config_from_args(args)
        profile = load_profile(args, config)
        tokenizer = None if args.trace else workload_tokenizer(args.model, args.tokenizer)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"profile: {profile.label}")
    if profile.source != "measured":
        print("  (an analytic ESTIMATE: no step was measured on this device)")
    if args.find_layout:
        return find_layout_main(args, config, profile, tokenizer)
    out = Path(args.output_dir) / f"{args.workload}-sim-{time.strftime('%Y%m%d-%H%M%S')}"
    log = ResultLog(None)
    log.note(f"simulated: {profile.label}; {args.replicas} replica(s), router {args.router}")
    wall = time.perf_counter()
    requests, traces, keys, per_replica = simulate_runs(args, config, profile, tokenizer, log)
    wall = time.perf_counter() - wall
    code = report(args, requests, traces, keys, log, out, False)
    if args.replicas > 1 and args.save_result and not args.no_plots:  # per engine: the first replica's pictures
        from batchserve.bench.outputs import _run_plots

        for label in traces:
            _run_plots(args, per_replica[label][0], out / f"{label.replace('@', '-at-')}-r0")
    if isinstance(profile.step_model, ParallelStepModel):
        share = profile.step_model.spent_share
        print(f"collectives and stage hand-overs: {100 * share:.1f}% of the simulated step time (all runs)")
    routed = {label: t.meta["routed"] for label, t in traces.items() if "routed" in t.meta}
    if args.replicas > 1:
        print(f"requests per replica: {routed}")
    print(f"simulated in {wall:.2f} s of wall time")
    return code


def find_layout_main(args: argparse.Namespace, config: EngineConfig, profile: Profile, tokenizer: Any) -> int:
    """The smallest layout meeting the target: 0 when one does, 3 when none within --max-hosts does."""
    try:
        target = Target(args.target_throughput, args.target_slo_attainment, slo_from_args(args))
        memory, shapes = host_memory(args.host_memory_gib), resolve_shapes(args.model_shapes)
        if args.trace:
            requests, arrivals = load_trace(args.trace, args.num_requests)
        else:
            requests, arrivals = (
                make_requests(args, tokenizer, args.num_requests, args.seed or 0),
                arrivals_from_args(args),
            )
        base = dataclasses.replace(config, tensor_parallel_size=1, pipeline_parallel_size=1)
        rows = find_layout(base, profile, shapes, requests, arrivals, target, args.max_hosts, memory,
                           ranks_per_host(args), collective_from_args(args), args.router, args.seed or 0)  # fmt: skip
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(f"{args.workload}: {args.num_requests} requests, {arrivals.describe()}; model shapes {shapes.name}")
    print(format_layout_rows(rows))
    if rows and rows[-1].meets:
        best = rows[-1]
        print(f"\nsmallest layout: {best.layout.describe()} on {best.hosts} host(s) (--tensor-parallel-size "
              f"{best.layout.tensor_parallel} --pipeline-parallel-size {best.layout.pipeline_parallel} --replicas "
              f"{best.layout.replicas})")  # fmt: skip
        return 0
    print(f"\nno layout on at most {args.max_hosts} host(s) meets the target", file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
