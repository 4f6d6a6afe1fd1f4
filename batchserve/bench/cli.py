"""`batchserve bench`: run a workload offline (in-process engine) or against an OpenAI-compatible server; report.

Examples:
  batchserve bench --offline --workload uniform --num-requests 64 --max-batch-size 16
  batchserve bench --offline --compare-static --workload uniform --num-requests 64 --max-batch-size 16
  batchserve bench --offline --workload mixed --sweep-rates 0.5,1,2,4
  batchserve bench --base-url http://localhost:8000 --workload longtail --request-rate 4
  batchserve bench --base-url http://localhost:8000 --grpc-target localhost:50051 --backend http,grpc
  batchserve bench --backend openai-chat --host 127.0.0.1 --port 8000 --dataset-name random --num-prompts 32

Against a server, `vllm bench serve`'s flags and defaults hold (no warm-up, ignore-eos off, prompts sent as text,
http://127.0.0.1:8000 when no target is given); what still differs from vLLM (--num-prompts 64, not 1000; the
default dataset; greedy sampling; files written unless --no-save-result): docs/bench-vllm-compat.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from batchserve.bench import offline
from batchserve.bench.args import (
    add_workload_arguments,
    arrivals_from_args,
    make_requests,
    normalize,
    percentile_metrics,
    slo_from_args,
)
from batchserve.bench.compare_checks import estimate_line, estimate_steps, noise_warning
from batchserve.bench.grpc_client import run_grpc
from batchserve.bench.http_client import CHAT_COMPLETIONS, COMPLETIONS, PROMPT_FORMATS, run_http, served_models
from batchserve.bench.metrics import summarize
from batchserve.bench.outputs import compare_line, write_outputs
from batchserve.bench.outputs import run_label as _label
from batchserve.bench.partial import ResultLog, sigterm_interrupts
from batchserve.bench.report import format_table, save_json
from batchserve.bench.trace import RunTrace
from batchserve.bench.warmup import warm_up, warm_up_http
from batchserve.bench.workloads import BenchRequest, describe
from batchserve.entrypoints.engine_args import ArgumentParser, add_engine_arguments, engine_config_from_args

# HTTP backends (ours and vLLM's names) -> the path they POST to unless --endpoint says
BACKEND_ENDPOINTS = {"http": COMPLETIONS, "openai": COMPLETIONS, "vllm": COMPLETIONS, "openai-chat": CHAT_COMPLETIONS}


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="batchserve bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    target = p.add_mutually_exclusive_group()
    target.add_argument("--offline", action="store_true", help="drive an in-process engine (engine options below)")
    target.add_argument("--base-url", help="an OpenAI-compatible server, e.g. http://localhost:8000 (default: "
                        "http://--host:--port, as vLLM's bench serve)")  # fmt: skip
    p.add_argument("--compare-static", action="store_true",
                   help="offline: run the same workload under static and max_utilization batching, side by side")  # fmt: skip
    p.add_argument("--sweep-rates", help="comma-separated request rates: one run each, throughput-vs-latency plot")
    p.add_argument("--output-dir", "--result-dir", dest="output_dir", default="bench_results",
                   help="summary JSON, traces, PNGs and requests.jsonl go here (default: bench_results)")  # fmt: skip
    p.add_argument("--save-result", action=argparse.BooleanOptionalAction, default=True,
                   help="write the files (--no-save-result: print the table only)")  # fmt: skip
    p.add_argument("--no-plots", action="store_true", help="no PNGs")
    p.add_argument("--timeline-steps", type=int, default=None,
                   help="draw only the first N steps in the batch timeline (default: all of them; past 1500 steps "
                   "a column shows one step in every k, as its title says)")  # fmt: skip
    g = p.add_argument_group("HTTP target")
    g.add_argument("--host", default="127.0.0.1", help="the server's host when --base-url is not given")
    g.add_argument("--port", type=int, default=8000, help="the server's port when --base-url is not given")
    g.add_argument("--endpoint", help="the path HTTP backends POST to (default: /v1/completions; openai-chat: "
                   "/v1/chat/completions)")  # fmt: skip
    g.add_argument("--model-name", "--served-model-name", dest="model_name",
                   help="model field of the requests (default: the first of /v1/models)")  # fmt: skip
    g.add_argument("--prompt-format", choices=PROMPT_FORMATS, default=None,
                   help="send token ids or text (default: text, as vLLM; chat endpoints always text)")  # fmt: skip
    g.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    g.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    g.add_argument("--grpc-target", help="HOST:PORT of `batchserve serve --grpc-port` (for --backend grpc)")
    g.add_argument("--backend", default="http",
                   help="comma-separated runs in order, each 'http' (OpenAI streaming completions; vLLM's names "
                        "'openai' and 'vllm' too), 'openai-chat' (streaming chat completions) or 'grpc' "
                        "(batchserve.v1.Generate): 'http,grpc' puts the front ends side by side")  # fmt: skip
    add_workload_arguments(p)
    add_engine_arguments(p)
    return p


def _policy_config(config: Any, policy: str) -> Any:
    return dataclasses.replace(config, scheduler=dataclasses.replace(config.scheduler, scheduler_policy=policy))


def _http_tokenizer(args: argparse.Namespace) -> Any:
    if args.tokenizer:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(args.tokenizer)
    from batchserve.models.loader import load_tokenizer

    return load_tokenizer(_served_model_path(args))


def _served_model_path(args: argparse.Namespace) -> Any:
    """Where the tokenizer of `--model` is: the model itself when it is a local model; else, as vLLM's bench takes
    --model, a name the server serves (its /v1/models): then it is also the requests' model field, and the card's
    root says what the server loaded (none: batchserve's default model)."""
    from batchserve.models.loader import ModelLoadError, resolve_model_path

    try:
        return resolve_model_path(args.model)
    except ModelLoadError as not_local:
        try:
            served = served_models(args.base_url, args.api_key)
        except (OSError, ValueError, KeyError) as exc:  # no server there, or not an OpenAI one
            raise ModelLoadError(f"{not_local}; and {args.base_url}/v1/models did not answer ({exc})") from None
        if args.model not in served:
            names = ", ".join(served) or "nothing"
            raise ModelLoadError(f"{not_local}; {args.base_url} serves {names}") from None
        args.model_name = args.model_name or args.model
        return resolve_model_path(served[args.model])


def _rates(args: argparse.Namespace) -> list[float | None]:
    if not args.sweep_rates:
        return [None]
    return [float(x) for x in args.sweep_rates.split(",") if x.strip()]


def run_offline_runs(
    args: argparse.Namespace, log: ResultLog
) -> tuple[list[BenchRequest], dict[str, RunTrace], list[tuple]]:
    """Every (policy, rate) run, one engine per policy sharing the loaded weights; the k-th rate of a sweep gets the
    workload of seed + k so that no run finds the previous one's prompts cached. With --compare-static the two
    policies' runs of a rate step alternately (run_lockstep), each timed by its own busy clock."""
    config = engine_config_from_args(args)
    policies = ["static", "max_utilization"] if args.compare_static else [config.scheduler.scheduler_policy]
    engines: list[Any] = []
    step_s = None  # the warm-up's median decode step (else its median step): the estimate's unit
    for policy in policies:
        like = engines[0] if engines else None
        engine = offline.build_engine(_policy_config(config, policy), like=like, share_runner=False)
        report = warm_up(engine, args)
        if report is not None:
            log.note(f"{policy}: {report.describe()}")
            step_s = step_s or report.decode_step_s or report.typical_s
        engines.append(engine)
    tokenizer = engines[0].tokenizer
    traces: dict[str, RunTrace] = {}
    keys: list[tuple] = []  # (label, policy, rate)
    first: list[BenchRequest] = []
    for k, rate in enumerate(_rates(args)):
        seed = (args.seed or 0) + k
        requests = make_requests(args, tokenizer, args.num_requests, seed)
        if args.compare_static and not first:
            steps = estimate_steps(requests, config.scheduler.max_batch_size, config.scheduler.max_num_tokens)
            log.note(estimate_line(steps, step_s, runs=len(_rates(args))))
        first = first or requests
        arrivals = arrivals_from_args(args, rate)
        lockstep = len(engines) > 1
        labels = [_label(policy, rate) for policy in policies]
        # lockstep runs share one bar: two bars redrawn in turn garble a terminal and fill a log with escape codes
        bar = _bar("+".join(labels), len(requests) * len(labels), args.no_progress) if lockstep else None
        runs = []
        for policy, engine, label in zip(policies, engines, labels, strict=True):
            clock = offline.BusyClock() if lockstep else time.monotonic
            runs.append(offline.OfflineRun(engine, requests, arrivals, seed, label, not args.no_progress, clock,
                                           bar=bar, on_result=log.recorder(label, clock)))  # fmt: skip
            keys.append((label, policy, rate))
        done = offline.run_lockstep(runs) if lockstep else [offline.drive(runs[0])]
        if bar is not None:
            bar.close()
        for policy, trace in zip(policies, done, strict=True):
            trace.meta.update(policy=policy, request_rate=arrivals.request_rate, seed=seed, lockstep=lockstep)
            traces[trace.label] = trace
            log.finish(trace.label, trace)
    return first, traces, keys


def run_http_runs(
    args: argparse.Namespace, log: ResultLog
) -> tuple[list[BenchRequest], dict[str, RunTrace], list[tuple]]:
    backends = _backends(args)  # checked before the tokenizer loads
    tokenizer = _http_tokenizer(args)
    first_http = next((backend for backend, _ in backends if backend != "grpc"), "http")
    report = warm_up_http(args, tokenizer, endpoint_of(args, first_http))
    if report is not None:
        log.note(report.describe())
    workloads: dict[int, list[BenchRequest]] = {}
    traces, keys = {}, []
    for k, rate in enumerate(_rates(args)):
        seed = (args.seed or 0) + k
        arrivals = arrivals_from_args(args, rate)
        for b, (backend, name) in enumerate(backends):
            run_seed = seed + 1000 * b  # each run its own prompts: none finds an earlier run's in the prefix cache
            requests = make_requests(args, tokenizer, args.num_requests, run_seed)
            workloads.setdefault(k, requests)
            label = _label(name, rate)
            if backend == "grpc":
                traces[label] = run_grpc(args.grpc_target, requests, arrivals, run_seed, label, not args.no_progress,
                                         args.timeout, args.api_key)  # fmt: skip
            else:
                traces[label] = run_http(
                    args.base_url, requests, arrivals, run_seed, args.model_name, args.prompt_format, tokenizer,
                    label, not args.no_progress, args.timeout, args.api_key, on_result=log.recorder(label),
                    endpoint=endpoint_of(args, backend),
                )  # fmt: skip
            traces[label].meta.update(policy=backend, request_rate=arrivals.request_rate, seed=run_seed)
            log.finish(label, traces[label])
            keys.append((label, backend, rate))
    return workloads[0], traces, keys


def endpoint_of(args: argparse.Namespace, backend: str) -> str:
    return args.endpoint or BACKEND_ENDPOINTS[backend]


def _backends(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(backend, run name) in order; a backend named twice is run twice (grpc, grpc-2)."""
    runs: list[tuple[str, str]] = []
    for backend in (b.strip() for b in args.backend.split(",") if b.strip()):
        if backend not in (*BACKEND_ENDPOINTS, "grpc"):
            raise ValueError(f"--backend takes {', '.join(BACKEND_ENDPOINTS)} and grpc, not {backend!r}")
        if backend == "grpc" and not args.grpc_target:
            raise ValueError("--backend grpc needs --grpc-target HOST:PORT")
        count = sum(b == backend for b, _ in runs) + 1
        runs.append((backend, backend if count == 1 else f"{backend}-{count}"))
    return runs or [("http", "http")]


def _noise_warnings(traces: dict[str, RunTrace], summaries: dict[str, dict], keys: list[tuple]) -> list[str]:
    """Per rate: whether same-shape steps varied more than the throughput ratio the comparison reports."""
    warnings = []
    for rate in dict.fromkeys(k[2] for k in keys):
        static, dynamic = _label("static", rate), _label("max_utilization", rate)
        s, d = summaries[static].get("output_throughput"), summaries[dynamic].get("output_throughput")
        warning = noise_warning(traces[static], traces[dynamic], d / s if s and d else None)
        if warning:
            warnings.append(warning)
    return warnings


def _bar(label: str, total: int, disabled: bool) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc=label, unit="req", disable=disabled)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.compare_static and not args.offline:
        parser.error("--compare-static needs --offline (a server has one fixed policy)")
    if not args.offline:
        args.base_url = args.base_url or f"http://{args.host}:{args.port}"
        args.prompt_format = args.prompt_format or "text"
    logging.getLogger("httpx").setLevel(logging.WARNING)  # else a line per request, over the progress bar
    out = Path(args.output_dir) / time.strftime("%Y%m%d-%H%M%S")
    log = ResultLog(out / "requests.jsonl" if args.save_result else None)
    interrupted = False
    try:
        normalize(args)
        out = out.with_name(f"{args.workload}-{out.name}")
        log.path = out / "requests.jsonl" if args.save_result else None
        if args.offline:  # once for the process, whose engines share it
            from batchserve.host.process import configure_torch

            config = engine_config_from_args(args)
            configure_torch(config.num_threads, config.seed)
        with sigterm_interrupts():
            requests, traces, keys = run_offline_runs(args, log) if args.offline else run_http_runs(args, log)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: report what finished
        interrupted, traces, keys = True, log.partial_traces(), []
        requests = []
    except (ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except httpx.TransportError as exc:
        print(f"error: no server answers at {args.base_url} ({exc}): start one (`batchserve serve`), give its "
              "--base-url or --host/--port, or run --offline", file=sys.stderr)  # fmt: skip
        return 2
    finally:
        log.close()
    return report(args, requests, traces, keys, log, out, interrupted)


def report(
    args: argparse.Namespace, requests: list[BenchRequest], traces: dict[str, RunTrace], keys: list[tuple],
    log: ResultLog, out: Path, interrupted: bool,
) -> int:  # fmt: skip
    """The table, and the files unless --no-save-result; exit status 130 when the run was interrupted."""
    if not traces:
        print("interrupted before any request finished", file=sys.stderr)
        return 130
    slo = slo_from_args(args)
    summaries = {lbl: summarize(t.requests, t.meta["duration_s"], slo, t.steps) for lbl, t in traces.items()}
    shape = describe(requests) if requests else {"num_requests": args.num_requests}
    title = f"{args.workload}: {shape['num_requests']} requests, {arrivals_from_args(args).describe()}"
    if interrupted:
        title += f" (INTERRUPTED: {sum(s['completed'] for s in summaries.values())} requests finished)"
    print(format_table(summaries, title, latencies=percentile_metrics(args)))
    if args.compare_static and not interrupted:
        print(compare_line(summaries, keys))
        for warning in _noise_warnings(traces, summaries, keys):
            print(warning)
    if not args.save_result:
        return 130 if interrupted else 0
    document = {
        "workload": {"name": args.workload, "seed": args.seed or 0, **shape},
        "args": {k: v for k, v in vars(args).items() if v is not None},
        "interrupted": interrupted,
        "warmup": log.notes,
        "runs": summaries,
    }
    out.mkdir(parents=True, exist_ok=True)
    files = [save_json(document, out / "summary.json"), *write_outputs(args, traces, summaries, out)]
    if log.path is not None and log.path.exists():
        files.append(log.path)
    print(f"\nwrote {len(files)} files to {out}/")
    return 130 if interrupted else 0


if __name__ == "__main__":
    sys.exit(main())
