"""`batchserve bench`: run a workload offline (in-process engine) or against an OpenAI-compatible server; report.

Examples:
  batchserve bench --offline --workload uniform --num-requests 64 --max-batch-size 16
  batchserve bench --offline --compare-static --workload uniform --num-requests 64 --max-batch-size 16
  batchserve bench --offline --workload mixed --sweep-rates 0.5,1,2,4
  batchserve bench --base-url http://localhost:8000 --workload longtail --request-rate 4
  batchserve bench --base-url http://localhost:8000 --grpc-target localhost:50051 --backend http,grpc
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time
from pathlib import Path
from typing import Any

from batchserve.bench import offline
from batchserve.bench.arrivals import PROCESSES, ArrivalProcess
from batchserve.bench.grpc_client import run_grpc
from batchserve.bench.http_client import PROMPT_FORMATS, run_http
from batchserve.bench.metrics import SLO, summarize
from batchserve.bench.report import format_table, save_json
from batchserve.bench.trace import RunTrace, save_chrome_trace
from batchserve.bench.workloads import WORKLOADS, BenchRequest, WorkloadOptions, describe, make_workload
from batchserve.entrypoints.engine_args import add_engine_arguments, engine_config_from_args


def add_workload_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("workload (reproducible from --seed)")
    g.add_argument("--workload", choices=WORKLOADS, default="uniform")
    g.add_argument("--dataset", help="ShareGPT-format JSON file (--workload sharegpt)")
    g.add_argument("--num-requests", type=int, default=64)
    g.add_argument("--input-len", type=int, help="prompt tokens (shared-prefix: the unique part; sharegpt: the max)")
    g.add_argument("--output-len", type=int, help="output tokens (uniform: the mean; longtail: the median)")
    g.add_argument("--spread", type=float, default=0.2, help="uniform: output lengths within +-spread of the mean")
    g.add_argument("--long-ratio", type=float, default=0.2, help="mixed: share of long summarisation requests")
    g.add_argument("--long-input-len", type=int, default=2000, help="mixed: prompt tokens of a long request")
    g.add_argument("--long-output-len", type=int, default=500, help="mixed: output tokens of a long request")
    g.add_argument("--sigma", type=float, default=0.8, help="longtail: sigma of the log-normal output length")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens of the common system prompt")
    g.add_argument("--max-output-len", type=int, default=2048, help="longtail / sharegpt: clip output lengths")
    g = p.add_argument_group("arrivals")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    g.add_argument("--arrival", choices=PROCESSES, default="poisson", help="inter-arrival distribution")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson, < 1 burstier)")
    g.add_argument("--max-concurrency", type=int, help="at most N requests in flight (fixed concurrency)")
    g = p.add_argument_group("SLO (goodput counts requests meeting both)")
    g.add_argument("--slo-ttft-ms", type=float, default=500.0)
    g.add_argument("--slo-tpot-ms", type=float, default=100.0)
    g.add_argument("--warmup-requests", type=int, default=2, help="offline: tiny requests run before timing")
    g.add_argument("--no-progress", action="store_true", help="no tqdm bar")


def workload_options(args: argparse.Namespace) -> WorkloadOptions:
    return WorkloadOptions(
        input_len=args.input_len, output_len=args.output_len, spread=args.spread, long_ratio=args.long_ratio,
        long_input_len=args.long_input_len, long_output_len=args.long_output_len, sigma=args.sigma,
        max_output_len=args.max_output_len, prefix_len=args.prefix_len, dataset=args.dataset,
    )  # fmt: skip


def arrivals_from_args(args: argparse.Namespace, rate: float | None = None) -> ArrivalProcess:
    a = ArrivalProcess(args.request_rate if rate is None else rate, args.arrival, args.burstiness, args.max_concurrency)
    a.validate()
    return a


def slo_from_args(args: argparse.Namespace) -> SLO:
    return SLO(args.slo_ttft_ms / 1000, args.slo_tpot_ms / 1000)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="batchserve bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--offline", action="store_true", help="drive an in-process engine (engine options below)")
    target.add_argument("--base-url", help="an OpenAI-compatible server, e.g. http://localhost:8000")
    p.add_argument("--compare-static", action="store_true",
                   help="offline: run the same workload under static and max_utilization batching, side by side")  # fmt: skip
    p.add_argument("--sweep-rates", help="comma-separated request rates: one run each, throughput-vs-latency plot")
    p.add_argument("--output-dir", default="bench_results", help="summary JSON, traces and PNGs go here")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--timeline-steps", type=int, default=600, help="steps shown in the batch timeline")
    g = p.add_argument_group("HTTP target")
    g.add_argument("--model-name", help="model field of the requests (default: the first of /v1/models)")
    g.add_argument("--prompt-format", choices=PROMPT_FORMATS, default="tokens", help="send token ids or text")
    g.add_argument("--api-key")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--grpc-target", help="HOST:PORT of `batchserve serve --grpc-port` (for --backend grpc)")
    g.add_argument("--backend", default="http",
                   help="comma-separated runs in order, each 'http' (OpenAI streaming completions) or 'grpc' "
                        "(batchserve.v1.Generate): 'http,grpc' puts the front ends side by side")  # fmt: skip
    add_workload_arguments(p)
    add_engine_arguments(p)
    return p


def _policy_config(config: Any, policy: str) -> Any:
    return dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, scheduler_policy=policy))


def warm_up(engine: Any, tokenizer: Any, n: int) -> None:
    if n <= 0:
        return
    warm = make_workload("uniform", tokenizer, n, seed=12345, options=WorkloadOptions(input_len=16, output_len=4))
    for r in warm:
        r.request_id = f"warmup-{r.request_id}"
    offline.run_offline(engine, warm, progress=False, label="warmup")


def _http_tokenizer(args: argparse.Namespace) -> Any:
    if args.tokenizer:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(args.tokenizer)
    from batchserve.models.loader import load_tokenizer, resolve_model_path

    return load_tokenizer(resolve_model_path(args.model))


def _rates(args: argparse.Namespace) -> list[float | None]:
    if not args.sweep_rates:
        return [None]
    return [float(x) for x in args.sweep_rates.split(",") if x.strip()]


def _label(policy: str, rate: float | None) -> str:
    return policy if rate is None else f"{policy}@{rate:g}"


def run_offline_runs(args: argparse.Namespace) -> tuple[list[BenchRequest], dict[str, RunTrace], list[tuple]]:
    """Every (policy, rate) run, one engine per policy sharing the loaded weights; the k-th rate of a sweep gets the
    workload of seed + k so that no run finds the previous one's prompts cached. With --compare-static the two
    policies' runs of a rate step alternately (run_lockstep), each timed by its own busy clock."""
    config = engine_config_from_args(args)
    policies = ["static", "max_utilization"] if args.compare_static else [config.scheduler.scheduler_policy]
    engines: list[Any] = []
    for policy in policies:
        like = engines[0] if engines else None
        engine = offline.build_engine(_policy_config(config, policy), like=like, share_runner=False)
        warm_up(engine, engine.tokenizer, args.warmup_requests)
        engines.append(engine)
    tokenizer = engines[0].tokenizer
    traces: dict[str, RunTrace] = {}
    keys: list[tuple] = []  # (label, policy, rate)
    first: list[BenchRequest] = []
    for k, rate in enumerate(_rates(args)):
        seed = (args.seed or 0) + k
        workload = make_workload(args.workload, tokenizer, args.num_requests, seed, workload_options(args))
        first = first or workload
        arrivals = arrivals_from_args(args, rate)
        lockstep = len(engines) > 1
        runs = []
        for policy, engine in zip(policies, engines, strict=True):
            clock = offline.BusyClock() if lockstep else time.monotonic
            label = _label(policy, rate)
            runs.append(offline.OfflineRun(engine, workload, arrivals, seed, label, not args.no_progress, clock))
            keys.append((label, policy, rate))
        done = offline.run_lockstep(runs) if lockstep else [offline.drive(runs[0])]
        for policy, trace in zip(policies, done, strict=True):
            trace.meta.update(policy=policy, request_rate=arrivals.request_rate, seed=seed, lockstep=lockstep)
            traces[trace.label] = trace
    return first, traces, keys


def run_http_runs(args: argparse.Namespace) -> tuple[list[BenchRequest], dict[str, RunTrace], list[tuple]]:
    backends = _backends(args)  # checked before the tokenizer loads
    tokenizer = _http_tokenizer(args)
    workloads: dict[int, list[BenchRequest]] = {}
    traces, keys = {}, []
    for k, rate in enumerate(_rates(args)):
        seed = (args.seed or 0) + k
        arrivals = arrivals_from_args(args, rate)
        for b, (backend, name) in enumerate(backends):
            run_seed = seed + 1000 * b  # each run its own prompts: none finds an earlier run's in the prefix cache
            workload = make_workload(args.workload, tokenizer, args.num_requests, run_seed, workload_options(args))
            workloads.setdefault(k, workload)
            label = _label(name, rate)
            if backend == "grpc":
                traces[label] = run_grpc(args.grpc_target, workload, arrivals, run_seed, label, not args.no_progress,
                                         args.timeout, args.api_key)  # fmt: skip
            else:
                traces[label] = run_http(
                    args.base_url, workload, arrivals, run_seed, args.model_name, args.prompt_format, tokenizer,
                    label, not args.no_progress, args.timeout, args.api_key,
                )  # fmt: skip
            traces[label].meta.update(policy=backend, request_rate=arrivals.request_rate, seed=run_seed)
            keys.append((label, backend, rate))
    return workloads[0], traces, keys


def _backends(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(backend, run name) in order; a backend named twice is run twice (grpc, grpc-2)."""
    runs: list[tuple[str, str]] = []
    for backend in (b.strip() for b in args.backend.split(",") if b.strip()):
        if backend not in ("http", "grpc"):
            raise ValueError(f"--backend takes http and grpc, not {backend!r}")
        if backend == "grpc" and not args.grpc_target:
            raise ValueError("--backend grpc needs --grpc-target HOST:PORT")
        count = sum(b == backend for b, _ in runs) + 1
        runs.append((backend, backend if count == 1 else f"{backend}-{count}"))
    return runs or [("http", "http")]


def write_outputs(args: argparse.Namespace, traces: dict[str, RunTrace], summaries: dict, out: Path) -> list[Path]:
    files = []
    for label, trace in traces.items():
        safe = label.replace("@", "-at-")
        trace.save_json(out / f"trace-{safe}.json")
        files.append(out / f"trace-{safe}.json")
        if trace.steps:
            save_chrome_trace(trace, out / f"trace-{safe}.perfetto.json")
            files.append(out / f"trace-{safe}.perfetto.json")
        if trace.steps and not args.no_plots:
            from batchserve.bench.plots import plot_batch_timeline, plot_kv_usage

            files.append(plot_batch_timeline(trace, out / f"timeline-{safe}.png", args.timeline_steps))
            files.append(plot_kv_usage(trace, out / f"kv-{safe}.png"))
    if args.sweep_rates and not args.no_plots:
        from batchserve.bench.plots import plot_throughput_latency

        points = [
            {**s, "label": traces[lbl].meta.get("policy", "http"), "request_rate": traces[lbl].meta["request_rate"]}
            for lbl, s in summaries.items()
        ]
        files.append(plot_throughput_latency(points, out / "throughput-latency.png"))
    return files


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compare_static and not args.offline:
        parser.error("--compare-static needs --offline (a server has one fixed policy)")
    try:
        if args.offline:  # once for the process, whose engines share it
            from batchserve.worker.device import configure_torch

            config = engine_config_from_args(args)
            configure_torch(config.num_threads, config.seed)
        requests, traces, keys = run_offline_runs(args) if args.offline else run_http_runs(args)
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    slo = slo_from_args(args)
    summaries = {lbl: summarize(t.requests, t.meta["duration_s"], slo, t.steps) for lbl, t in traces.items()}
    out = Path(args.output_dir) / time.strftime(f"{args.workload}-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    title = f"{args.workload}: {describe(requests)['num_requests']} requests, {arrivals_from_args(args).describe()}"
    print(format_table(summaries, title))
    if args.compare_static:
        print(compare_line(summaries, keys))
    report = {
        "workload": {"name": args.workload, "seed": args.seed or 0, **describe(requests)},
        "args": {k: v for k, v in vars(args).items() if v is not None},
        "runs": summaries,
    }
    files = [save_json(report, out / "summary.json"), *write_outputs(args, traces, summaries, out)]
    print(f"\nwrote {len(files)} files to {out}/")
    return 0


def compare_line(summaries: dict[str, dict], keys: list[tuple]) -> str:
    """The static-vs-dynamic verdict: measured throughput, and output tokens per step (the same ratio with the
    hardware's speed taken out: what batching alone gained), with both occupancies."""
    lines = []
    for rate in dict.fromkeys(k[2] for k in keys):
        s, d = summaries[_label("static", rate)], summaries[_label("max_utilization", rate)]
        where = "" if rate is None else f" at {rate:g} req/s"
        lines.append(
            f"dynamic vs static{where}: output throughput {_ratio(d, s, 'output_throughput')}, "
            f"output tokens/step {_ratio(d, s, 'output_tokens_per_step')}; batch occupancy "
            f"{100 * s.get('batch_occupancy', math.nan):.1f}% static vs {100 * d.get('batch_occupancy', math.nan):.1f}% "
            f"dynamic (while requests waited: {100 * s.get('batch_occupancy_saturated', math.nan):.1f}% vs "
            f"{100 * d.get('batch_occupancy_saturated', math.nan):.1f}%)"
        )
    return "\n".join(lines)


def _ratio(a: dict, b: dict, key: str) -> str:
    x, y = a.get(key), b.get(key)
    if not x or not y:
        return "n/a"
    return f"{x / y:.3f}x ({100 * (x / y - 1):+.1f}%)"


if __name__ == "__main__":
    sys.exit(main())
