"""The workload, arrival, SLO and reporting flags that `bench` and `tune` share, with vLLM's `bench serve` names as
aliases (--num-prompts, --dataset-name random, --random-input-len, --random-output-len, --ignore-eos, ...)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from batchserve.bench.arrivals import PROCESSES, ArrivalProcess
from batchserve.bench.metrics import SLO
from batchserve.bench.repetitive import REPETITIVE_WORKLOADS
from batchserve.bench.workloads import WORKLOADS, BenchRequest, WorkloadOptions, make_workload

# vLLM's --dataset-name random: prompts of exactly --random-input-len tokens, outputs within --random-range-ratio of
# --random-output-len: our uniform workload, with vLLM's default lengths.
VLLM_DATASETS = {"random": "uniform"}
VLLM_RANDOM_LENGTHS = (1024, 128)  # vLLM's --random-input-len / --random-output-len defaults
GOODPUT_KEYS = {"ttft": "slo_ttft_ms", "tpot": "slo_tpot_ms"}  # vLLM's --goodput KEY:MS
PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")  # vLLM's names for --percentile-metrics


def add_workload_arguments(p: argparse.ArgumentParser, slo_defaults: tuple[float, float] | None = None) -> None:
    """slo_defaults: (TTFT, TPOT) ms for a command that needs an SLO (tune); bench has none unless asked."""
    g = p.add_argument_group("workload (reproducible from --seed)")
    g.add_argument("--workload", "--dataset-name", dest="workload", choices=(*WORKLOADS, *VLLM_DATASETS),
                   default="uniform", help="what the requests look like; random (vLLM's name): uniform with "
                   "--spread 0 unless --random-range-ratio says otherwise (default: uniform)")  # fmt: skip
    g.add_argument("--dataset", "--dataset-path", dest="dataset", help="ShareGPT-format JSON file (sharegpt)")
    g.add_argument("--num-requests", "--num-prompts", dest="num_requests", type=int, default=64,
                   help="requests per run (default: 64)")  # fmt: skip
    g.add_argument("--input-len", "--random-input-len", dest="input_len", type=int,
                   help="prompt tokens (shared-prefix: the unique part; sharegpt: the max)")  # fmt: skip
    g.add_argument("--output-len", "--random-output-len", dest="output_len", type=int,
                   help="output tokens (uniform: the mean; longtail: the median)")  # fmt: skip
    g.add_argument("--spread", "--random-range-ratio", dest="spread", type=float, default=None,
                   help="uniform: output lengths within +-spread of the mean (default: 0.2; random: 0)")  # fmt: skip
    g.add_argument("--long-ratio", type=float, default=0.2, help="mixed: share of long summarisation requests")
    g.add_argument("--long-input-len", type=int, default=2000, help="mixed: prompt tokens of a long request")
    g.add_argument("--long-output-len", type=int, default=500, help="mixed: output tokens of a long request")
    g.add_argument("--sigma", type=float, default=0.8, help="longtail: sigma of the log-normal output length")
    g.add_argument("--prefix-len", type=int, default=512, help="shared-prefix: tokens of the common system prompt")
    g.add_argument(
        "--num-prefixes", type=int, default=1,
        help="shared-prefix: distinct system prompts, each shared by num_requests / num_prefixes users (default: 1)",
    )  # fmt: skip
    g.add_argument("--max-output-len", type=int, default=2048, help="longtail / sharegpt: clip output lengths")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=None,
                   help="generate every request's output length even past EOS (default: on offline, so runs "
                   "compare; off against a server, as vLLM's bench serve)")  # fmt: skip
    g = p.add_argument_group("arrivals")
    g.add_argument("--request-rate", type=float, default=math.inf, help="requests/s (default inf: all at once)")
    g.add_argument("--arrival", choices=PROCESSES, default="poisson", help="inter-arrival distribution")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape (1 = Poisson, < 1 burstier)")
    g.add_argument("--max-concurrency", type=int, help="at most N requests in flight (fixed concurrency)")
    g = p.add_argument_group("SLO and reporting")
    ttft, tpot = slo_defaults or (None, None)
    g.add_argument("--slo-ttft-ms", type=float, default=ttft, help="goodput counts requests within both SLOs "
                   f"(default: {'no SLO, no goodput' if ttft is None else ttft})")  # fmt: skip
    g.add_argument("--slo-tpot-ms", type=float, default=tpot, help="see --slo-ttft-ms; one alone bounds only itself "
                   f"(default: {'none' if tpot is None else tpot})")  # fmt: skip
    g.add_argument("--percentile-metrics", default=",".join(PERCENTILE_METRICS),
                   help=f"latencies whose percentiles the table shows, of {','.join(PERCENTILE_METRICS)} "
                   "(default: all)")  # fmt: skip
    g.add_argument("--goodput", nargs="+", metavar="KEY:MS",
                   help="vLLM's form of the SLO: ttft:MS and/or tpot:MS (= --slo-ttft-ms / --slo-tpot-ms)")  # fmt: skip
    g.add_argument("--warmup-requests", "--num-warmups", dest="warmup_requests", type=int, default=None,
                   help="requests shaped like the workload run before timing, outputs cut short (default: offline "
                   "max_batch_size; against a server 0, as vLLM's --num-warmups)")  # fmt: skip
    g.add_argument("--no-progress", "--disable-tqdm", dest="no_progress", action="store_true",
                   help="no progress bar")  # fmt: skip


def normalize(args: argparse.Namespace) -> argparse.Namespace:
    """vLLM's dataset names as ours; checks what argparse cannot. Raises ValueError."""
    if args.workload in VLLM_DATASETS:
        args.workload = VLLM_DATASETS[args.workload]
        args.spread = 0.0 if args.spread is None else args.spread
        args.input_len = VLLM_RANDOM_LENGTHS[0] if args.input_len is None else args.input_len
        args.output_len = VLLM_RANDOM_LENGTHS[1] if args.output_len is None else args.output_len
    args.spread = 0.2 if args.spread is None else args.spread
    percentile_metrics(args)
    goodput_slo(args)
    return args


def goodput_slo(args: argparse.Namespace) -> None:
    """vLLM's --goodput ttft:500 tpot:100 as --slo-ttft-ms / --slo-tpot-ms. Raises ValueError."""
    for item in getattr(args, "goodput", None) or []:
        key, _, value = item.partition(":")
        if key not in GOODPUT_KEYS:
            raise ValueError(f"--goodput takes {' and '.join(f'{k}:MS' for k in GOODPUT_KEYS)}, not {item!r}")
        try:
            setattr(args, GOODPUT_KEYS[key], float(value))
        except ValueError:
            raise ValueError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None


def against_a_server(args: argparse.Namespace) -> bool:
    """Whether the run drives a server (vLLM's defaults) rather than an in-process engine or a simulation."""
    return not getattr(args, "offline", True)


def percentile_metrics(args: argparse.Namespace) -> tuple[str, ...]:
    chosen = tuple(m.strip() for m in args.percentile_metrics.split(",") if m.strip())
    unknown = set(chosen) - set(PERCENTILE_METRICS)
    if unknown:
        raise ValueError(f"--percentile-metrics takes {','.join(PERCENTILE_METRICS)}, not {','.join(sorted(unknown))}")
    return chosen


def workload_options(args: argparse.Namespace) -> WorkloadOptions:
    spread = 0.2 if args.spread is None else args.spread
    return WorkloadOptions(
        input_len=args.input_len, output_len=args.output_len, spread=spread, long_ratio=args.long_ratio,
        long_input_len=args.long_input_len, long_output_len=args.long_output_len, sigma=args.sigma,
        max_output_len=args.max_output_len, prefix_len=args.prefix_len, num_prefixes=args.num_prefixes, dataset=args.dataset,
    )  # fmt: skip


def make_requests(args: argparse.Namespace, tokenizer: Any, count: int, seed: int) -> list[BenchRequest]:
    """`count` requests of the workload the flags describe."""
    requests = make_workload(args.workload, tokenizer, count, seed, workload_options(args))
    if args.ignore_eos is None and args.workload in REPETITIVE_WORKLOADS:
        return requests  # their answers end where the model ends them: what speculation predicts is measured
    ignore_eos = not against_a_server(args) if args.ignore_eos is None else args.ignore_eos
    for r in requests:
        r.ignore_eos = ignore_eos
    return requests


def arrivals_from_args(args: argparse.Namespace, rate: float | None = None) -> ArrivalProcess:
    a = ArrivalProcess(args.request_rate if rate is None else rate, args.arrival, args.burstiness, args.max_concurrency)
    a.validate()
    return a


def slo_from_args(args: argparse.Namespace) -> SLO | None:
    """None unless an SLO was asked for: no goodput is reported against a target nobody set."""
    if args.slo_ttft_ms is None and args.slo_tpot_ms is None:
        return None
    ttft, tpot = args.slo_ttft_ms, args.slo_tpot_ms
    return SLO(math.inf if ttft is None else ttft / 1000, math.inf if tpot is None else tpot / 1000)
