"""Benchmark arithmetic on recorded timings: no engine, no clock, no I/O.

Definitions (all times in seconds, from the request's arrival = when it was due to be sent):
  TTFT  = first_token_time - arrival
  E2E   = finish_time - arrival
  TPOT  = (E2E - TTFT) / (output_tokens - 1)        undefined for a single output token
  ITL   = gaps between consecutive token deliveries (a streamed chunk of k tokens counts as one delivery)
  goodput = requests meeting the SLO (TTFT <= slo_ttft and TPOT <= slo_tpot; TPOT undefined counts as met) / duration,
            reported only when an SLO is given
  batch occupancy = sum over steps of sequences scheduled / (steps * max_batch_size)
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    request_id: str
    prompt_len: int
    output_len: int  # tokens actually received
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per delivery (step or streamed chunk)
    success: bool = True
    error: str = ""
    category: str = ""
    num_cached_tokens: int | None = None  # None: the target did not say (HTTP)
    num_preemptions: int | None = None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def e2e(self) -> float | None:
        return None if self.finish_time is None else self.finish_time - self.arrival_time

    @property
    def tpot(self) -> float | None:
        if self.output_len < 2 or self.ttft is None or self.e2e is None:
            return None
        return (self.e2e - self.ttft) / (self.output_len - 1)

    @property
    def itls(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:], strict=False)]

    # What every streaming client records (HTTP, gRPC): a delivery of tokens, the end of the stream, a failure.
    def record_delivery(self, now: float) -> None:
        self.token_times.append(now)
        if self.first_token_time is None:
            self.first_token_time = now

    def end_stream(self, now: float, output_len: int) -> None:
        self.finish_time, self.output_len = now, output_len
        if self.first_token_time is None:
            raise RuntimeError("the stream carried no tokens")

    def record_failure(self, exc: BaseException) -> None:
        self.success, self.error = False, f"{type(exc).__name__}: {exc}"


@dataclass
class SLO:
    ttft_s: float = 0.5
    tpot_s: float = 0.1

    def met_by(self, r: RequestResult) -> bool:
        if not r.success or r.ttft is None:
            return False
        return r.ttft <= self.ttft_s and (r.tpot is None or r.tpot <= self.tpot_s)


def percentile(values: Sequence[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default); nan for no values."""
    if not values:
        return math.nan
    xs = sorted(values)
    rank = (len(xs) - 1) * p / 100.0
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float]:
    """mean and percentiles, multiplied by scale (1000 for milliseconds)."""
    vals = [v * scale for v in values]
    out = {"mean": sum(vals) / len(vals) if vals else math.nan}
    out.update({f"p{p}": percentile(vals, p) for p in PERCENTILES})
    return out


# SchedulerStats' counters that run from the engine's start: a run's share is the last step's minus the first's
CUMULATIVE_COUNTERS = ("prefix_cache_queries", "prefix_cache_hits", "spec_num_draft_tokens", "spec_num_accepted_tokens",
                       "spec_num_drafts", "spec_num_emitted_tokens")  # fmt: skip


@dataclass
class StepSample:
    """One engine step as the benchmark saw it: the timing and the scheduler's stats (SchedulerStats fields)."""

    start: float
    end: float
    num_scheduled_seqs: int = 0
    max_batch_size: int = 1
    num_waiting: int = 0
    num_running: int = 0
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0
    num_preempted: int = 0
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_blocks_cached_free: int = 0
    kv_blocks_free: int = 0
    prefix_cache_queries: int = 0  # cumulative, since the start of the run (the driver subtracts its baseline)
    prefix_cache_hits: int = 0
    spec_num_draft_tokens: int = 0  # speculative decoding, cumulative like the prefix cache's counters
    spec_num_accepted_tokens: int = 0
    spec_num_drafts: int = 0  # verification steps
    spec_num_emitted_tokens: int = 0
    scheduled: dict[str, tuple[int, bool]] = field(default_factory=dict)  # req_id -> (tokens, is prefill)
    finished: list[str] = field(default_factory=list)  # requests that finished at this step
    padding: list[str] = field(default_factory=list)  # finished requests computed as padding (static batching)

    @classmethod
    def from_stats(cls, start: float, end: float, stats: Any, finished: list[str] | None = None) -> StepSample:
        names = [
            "num_scheduled_seqs", "max_batch_size", "num_waiting", "num_running", "num_prefill_tokens",
            "num_decode_tokens", "kv_blocks_total", "kv_blocks_used", "kv_blocks_cached_free", "kv_blocks_free",
            *CUMULATIVE_COUNTERS,
        ]  # fmt: skip
        values = {n: getattr(stats, n, 0) for n in names}
        scheduled = {k: (int(v[0]), bool(v[1])) for k, v in (getattr(stats, "scheduled", None) or {}).items()}
        if not values["num_scheduled_seqs"] and scheduled:
            values["num_scheduled_seqs"] = len(scheduled)
        return cls(
            start, end, **values, num_preempted=getattr(stats, "num_preempted_this_step", 0),
            scheduled=scheduled, finished=list(finished or []), padding=list(getattr(stats, "padding", None) or []),
        )  # fmt: skip

    @property
    def kv_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0


def batch_occupancy(steps: Sequence[StepSample]) -> float:
    """Useful sequence slots over all slots, across every step."""
    slots = sum(s.max_batch_size for s in steps)
    return sum(s.num_scheduled_seqs for s in steps) / slots if slots else math.nan


def prefill_time_share(steps: Sequence[StepSample]) -> float:
    """Share of the steps' time spent in steps that prefill (alone or mixed with decodes)."""
    total = sum(s.end - s.start for s in steps)
    return sum(s.end - s.start for s in steps if s.num_prefill_tokens) / total if total > 0 else math.nan


def padding_bound(static: dict[str, Any], dynamic: dict[str, Any]) -> float:
    """The most continuous batching can gain over static in the saturated phase by removing padding alone: the same
    prefill time, and decode steps that cost what static's (padded, full-batch) ones do but carry only useful rows,
    so there are (static's occupancy in its decode steps) / (dynamic's occupancy) as many. Prefill time is not padding: where it is a large
    share of the run, this bound is well below the occupancy ratio."""
    share = static.get("prefill_time_share_saturated", math.nan)
    occ_s, occ_d = (
        static.get("decode_occupancy_saturated", math.nan),
        dynamic.get("batch_occupancy_saturated", math.nan),
    )
    return 1 / (share + (1 - share) * occ_s / occ_d) if occ_d else math.nan


def summarize(
    results: Sequence[RequestResult],
    duration_s: float,
    slo: SLO | None = None,
    steps: Sequence[StepSample] = (),
) -> dict[str, Any]:
    """Everything the report prints, as a flat-ish JSON-able dict (latencies in milliseconds); goodput only against
    a given SLO."""
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_len for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: math.nan)
    summary: dict[str, Any] = {
        "num_requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": rate(len(ok)),
        "output_throughput": rate(out_tokens),
        "total_token_throughput": rate(in_tokens + out_tokens),
        "ttft_ms": distribution([r.ttft for r in ok if r.ttft is not None], 1000),
        "tpot_ms": distribution([r.tpot for r in ok if r.tpot is not None], 1000),
        "itl_ms": distribution([g for r in ok for g in r.itls], 1000),
        "e2e_ms": distribution([r.e2e for r in ok if r.e2e is not None], 1000),
    }
    if slo is not None:
        good = [r for r in ok if slo.met_by(r)]
        summary.update(
            slo_ttft_ms=slo.ttft_s * 1000,
            slo_tpot_ms=slo.tpot_s * 1000,
            goodput=rate(len(good)),  # requests/s meeting the SLO
            goodput_tokens=rate(sum(r.output_len for r in good)),
            slo_attainment=len(good) / len(results) if results else math.nan,
        )
    if any(r.num_preemptions is not None for r in results):
        summary["num_preemptions"] = sum(r.num_preemptions or 0 for r in results)
    if any(r.num_cached_tokens is not None for r in ok):
        summary["prefix_cache_hit_rate"] = _request_hit_rate(ok)
    if steps:
        summary.update(step_summary(steps))
        # tokens generated per forward pass: batching efficiency, whatever the speed of the hardware (or a busy host)
        summary["output_tokens_per_step"] = out_tokens / len(steps)
        summary["output_throughput_saturated"] = saturated_throughput(ok, steps)
    return summary


def saturated_throughput(results: Sequence[RequestResult], steps: Sequence[StepSample]) -> float:
    """Output tok/s from the first step to the last one that left requests waiting: the steady state of a saturated
    server, without the ramp-down once the queue is empty (where every policy runs part-empty batches)."""
    end = max((s.end for s in steps if s.num_waiting > 0), default=None)
    if end is None or end <= steps[0].start:
        return math.nan
    return sum(1 for r in results for t in r.token_times if t <= end) / (end - steps[0].start)


def _request_hit_rate(results: Sequence[RequestResult]) -> float:
    prompt = sum(r.prompt_len for r in results)
    return sum(r.num_cached_tokens or 0 for r in results) / prompt if prompt else math.nan


def step_summary(steps: Sequence[StepSample]) -> dict[str, Any]:
    saturated = [s for s in steps if s.num_waiting > 0]
    decoding = [s for s in saturated if not s.num_prefill_tokens]
    last = steps[-1]
    out: dict[str, Any] = {
        "num_steps": len(steps),
        "batch_occupancy": batch_occupancy(steps),
        # while requests were waiting: how full the batch was when it could have been full
        "batch_occupancy_saturated": batch_occupancy(saturated) if saturated else math.nan,
        "prefill_time_share_saturated": prefill_time_share(saturated) if saturated else math.nan,
        "decode_occupancy_saturated": batch_occupancy(decoding) if decoding else math.nan,
        "mean_seqs_per_step": sum(s.num_scheduled_seqs for s in steps) / len(steps),
        "mean_tokens_per_step": sum(s.num_prefill_tokens + s.num_decode_tokens for s in steps) / len(steps),
        "mean_step_ms": 1000 * sum(s.end - s.start for s in steps) / len(steps),
        "kv_usage_mean": sum(s.kv_usage for s in steps) / len(steps),
        "kv_usage_max": max(s.kv_usage for s in steps),
        "step_preemptions": sum(s.num_preempted for s in steps),
    }
    if last.prefix_cache_queries > 0:  # the scheduler's counters, counted from the start of the run
        out["prefix_cache_hit_rate"] = last.prefix_cache_hits / last.prefix_cache_queries
    if last.spec_num_draft_tokens > 0:
        out["spec_acceptance_rate"] = last.spec_num_accepted_tokens / last.spec_num_draft_tokens
        out["spec_tokens_per_verify"] = last.spec_num_emitted_tokens / last.spec_num_drafts
    return out
