"""Warm-up before timing: requests shaped like the workload (its generator and lengths, another seed, outputs cut
short), all at once, so the first timed step does not pay for what a process pays once: the first forward of each
shape (allocator growth, kernel selection), the largest prefill the token budget allows, a full batch's decode. Tiny
requests covered none of it: the first timed step still took seconds, and the first rate of a sweep looked 20x worse
than the next."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchserve.bench import offline
from batchserve.bench.args import make_requests
from batchserve.bench.http_client import COMPLETIONS, run_http
from batchserve.bench.metrics import RequestResult
from batchserve.bench.trace import RunTrace
from batchserve.bench.workloads import BenchRequest

WARMUP_SEED = 987_654_321  # far from any run's seed + k: no prompt in common with a timed run
WARMUP_OUTPUT_TOKENS = 8  # enough decode steps at the full batch


@dataclass
class WarmupReport:
    num_requests: int
    duration_s: float
    first_s: float  # offline: the first step; HTTP: the first request's TTFT
    typical_s: float  # offline: the median step; HTTP: the median TTFT
    unit: str  # "step" or "TTFT"
    decode_step_s: float | None = None  # offline: the median step without prefill tokens (most of a run's steps)

    def describe(self) -> str:
        return (
            f"warm-up (not timed): {self.num_requests} requests shaped like the workload, outputs cut to "
            f"{WARMUP_OUTPUT_TOKENS} tokens, {self.duration_s:.1f} s; first {self.unit} {1000 * self.first_s:.0f} ms, "
            f"median {1000 * self.typical_s:.0f} ms"
        )


def warmup_requests(make: Callable[[int, int], list[BenchRequest]], count: int) -> list[BenchRequest]:
    """`count` requests from `make(count, seed)` (the workload's generator), renamed and cut short."""
    requests = make(count, WARMUP_SEED)
    for r in requests:
        r.request_id = f"warmup-{r.request_id}"
        r.output_len = min(r.output_len, WARMUP_OUTPUT_TOKENS)
    return requests


def warm_up(engine: Any, args: argparse.Namespace) -> WarmupReport | None:
    """Offline: a full batch (max_batch_size) of them, unless --warmup-requests says how many."""
    count = engine.config.scheduler.max_batch_size if args.warmup_requests is None else args.warmup_requests
    if count <= 0:
        return None
    requests = warmup_requests(lambda n, seed: make_requests(args, engine.tokenizer, n, seed), count)
    started = time.monotonic()
    return report_of(offline.run_offline(engine, requests, progress=False, label="warmup"), started)


def warm_up_http(args: argparse.Namespace, tokenizer: Any, endpoint: str = COMPLETIONS) -> WarmupReport | None:
    """Over HTTP: none unless --warmup-requests / --num-warmups says how many (vLLM's default), sent to the first
    HTTP backend's endpoint."""
    count = 0 if args.warmup_requests is None else args.warmup_requests
    if count <= 0:
        return None
    requests = warmup_requests(lambda n, seed: make_requests(args, tokenizer, n, seed), count)
    started = time.monotonic()
    trace = run_http(args.base_url, requests, None, 0, args.model_name, args.prompt_format, tokenizer, "warmup",
                     False, args.timeout, args.api_key, endpoint=endpoint)  # fmt: skip
    failed = [r.error for r in trace.requests if not r.success]
    if failed:
        raise OSError(f"the warm-up requests failed: {failed[0]}")
    return report_of(trace, started)


def report_of(trace: RunTrace, started: float) -> WarmupReport:
    """What the warm-up run cost: by engine step offline, by TTFT over HTTP (no steps seen)."""
    duration = time.monotonic() - started
    if trace.steps:
        times = [s.end - s.start for s in trace.steps]
        decode = [s.end - s.start for s in trace.steps if s.num_prefill_tokens == 0 and s.num_decode_tokens]
        decode_s = statistics.median(decode) if decode else None
        return WarmupReport(len(trace.requests), duration, times[0], statistics.median(times), "step", decode_s)
    ttfts = [r.ttft for r in sorted(trace.requests, key=_arrival) if r.ttft is not None] or [0.0]
    return WarmupReport(len(trace.requests), duration, ttfts[0], statistics.median(ttfts), "TTFT")


def _arrival(r: RequestResult) -> float:
    return r.arrival_time
