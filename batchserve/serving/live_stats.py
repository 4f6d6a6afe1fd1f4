"""The engine's recent history for the live dashboard and `batchserve doctor`: the last few hundred steps (what each
batched against the budgets) and the requests that finished in the last minute (their latencies), kept in memory.

Fed by a step listener on the engine loop thread; `snapshot` may run on any thread (one lock guards both rings).
Times are wall-clock seconds (time.time()), so that a reader on another machine can line them up.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import asdict, astuple, dataclass, fields
from typing import Any

from batchserve.core.outputs import SchedulerStats
from batchserve.engine.async_engine import AsyncLLMEngine
from batchserve.engine.llm_engine import LLMEngine
from batchserve.engine.outputs import CompletionDelta
from batchserve.serving.kv_tier_metrics import tier_summary

STEP_RING = 600  # steps kept: the dashboard draws the last few hundred, doctor polls with ?since=
LATENCY_WINDOW_S = 60.0  # the percentiles cover the requests finished this long ago at most
PERCENTILES = (50, 90, 99)


@dataclass(slots=True)
class StepPoint:
    """One engine step that computed something."""

    index: int
    end_time: float
    duration_s: float
    prefill_tokens: int
    decode_tokens: int
    seqs: int
    waiting: int
    running: int
    kv_blocks_used: int
    preempted: int
    kv_slots_allocated: int  # token slots in the running requests' blocks
    kv_slots_filled: int  # of which hold a computed token


STEP_FIELDS = tuple(f.name for f in fields(StepPoint))


@dataclass(slots=True)
class RequestPoint:
    """One finished request's sizes and latencies (seconds; None where the request never got that far)."""

    request_id: str
    arrival_time: float
    finished_time: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int
    preemptions: int
    finish_reason: str
    queue_s: float | None
    ttft_s: float | None
    tpot_s: float | None
    e2e_s: float
    slo_met: bool | None = None  # within its TTFT / TPOT targets; None: it had none
    adapter: str | None = None  # the LoRA adapter it ran with; None: the base model


class LiveStats:
    """Recent steps and finished requests of one engine."""

    def __init__(self, step_ring: int = STEP_RING, latency_window_s: float = LATENCY_WINDOW_S) -> None:
        self.latency_window_s = latency_window_s
        self._lock = threading.Lock()
        self._steps: deque[StepPoint] = deque(maxlen=step_ring)
        self._requests: deque[RequestPoint] = deque()
        self._last: SchedulerStats | None = None
        self._config: dict[str, Any] = {}
        self._totals = {"requests_finished": 0, "generation_tokens": 0, "prompt_tokens": 0, "steps": 0}
        self._wall_offset = time.time() - time.monotonic()  # the engine's times are monotonic
        self._engine: LLMEngine | None = None  # read at snapshot time for the disk tier's panel

    def attach(self, engine: AsyncLLMEngine) -> LiveStats:
        self._config = {k: v for k, v in engine.engine.effective_config().items() if v is not None}
        self._engine = engine.engine
        engine.step_listeners.append(self.on_step)
        return self

    # ------------------------------------------------------------------ engine loop thread
    def on_step(self, engine: LLMEngine, outputs: Sequence[CompletionDelta]) -> None:
        stats = engine.last_stats
        end = time.time()
        finished = [self._request_point(out) for out in outputs if out.finished]
        generated = sum(len(out.delta_token_ids) for out in outputs)
        with self._lock:
            self._last = stats
            self._totals["steps"] += 1
            self._totals["generation_tokens"] += generated
            if stats is not None and stats.num_scheduled_seqs:
                self._steps.append(_step_point(engine.num_steps - 1, end, engine.last_step_time_s, stats))
            for point in finished:
                self._requests.append(point)
                self._totals["requests_finished"] += 1
                self._totals["prompt_tokens"] += point.prompt_tokens
            self._forget_old(end)

    def _request_point(self, out: CompletionDelta) -> RequestPoint:
        m, wall = out.metrics, self._wall_offset
        first_token = m.first_token_time
        finished = m.finished_time if m.finished_time is not None else time.monotonic()
        tpot = None
        if first_token is not None and out.num_output_tokens > 1:
            tpot = (finished - first_token) / (out.num_output_tokens - 1)
        return RequestPoint(
            request_id=out.request_id, arrival_time=m.arrival_time + wall, finished_time=finished + wall,
            prompt_tokens=out.num_prompt_tokens, output_tokens=out.num_output_tokens,
            cached_tokens=m.num_cached_tokens, preemptions=m.num_preemptions,
            finish_reason=str(out.finish_reason or "abort"),
            queue_s=None if m.first_scheduled_time is None else m.first_scheduled_time - m.arrival_time,
            ttft_s=None if first_token is None else first_token - m.arrival_time,
            tpot_s=tpot, e2e_s=finished - m.arrival_time, slo_met=m.slo_met(out.num_output_tokens),
            adapter=out.lora_name,
        )  # fmt: skip

    def _forget_old(self, now: float) -> None:
        while self._requests and self._requests[0].finished_time < now - self.latency_window_s:
            self._requests.popleft()

    # ------------------------------------------------------------------ any thread
    def snapshot(
        self, since_step: int = -1, with_requests: bool = False, finished_after: float = 0.0, replica: str = ""
    ) -> dict[str, Any]:
        """A JSON-able view: the current state, the steps after `since_step`, the latency percentiles of the last
        minute, the effective configuration; with_requests: each of the last minute's requests finished after
        `finished_after` (wall time) too. `replica` is for the Ray app's reports: one engine here, so any id is
        unknown (LookupError)."""
        if replica:
            raise LookupError(
                f"no replica {replica!r}: this server runs one engine (replicas are `serve --replicas N`)"
            )
        now = time.time()
        with self._lock:
            self._forget_old(now)
            steps = [astuple(s) for s in self._steps if s.index > since_step]
            requests = list(self._requests)
            last, totals = self._last, dict(self._totals)
        snapshot = {
            "time": now,
            "config": self._config,
            "limits": {k: _int(self._config.get(k)) for k in ("max_num_tokens", "max_batch_size", "num_kv_blocks")},
            "now": _now(last, totals),
            "step_fields": list(STEP_FIELDS),
            "steps": steps,
            "latency": latency_summary(requests, self.latency_window_s),
        }
        tier = tier_summary(self._engine) if self._engine is not None else None
        if tier is not None:  # the disk KV tier's panel (docs/kv-offload.md#metrics)
            snapshot["kv_tier"] = tier
        if with_requests:
            snapshot["requests"] = [asdict(r) for r in requests if r.finished_time > finished_after]
        return snapshot


def _step_point(index: int, end: float, duration_s: float, stats: SchedulerStats) -> StepPoint:
    return StepPoint(
        index=index, end_time=end, duration_s=duration_s, prefill_tokens=stats.num_prefill_tokens,
        decode_tokens=stats.num_decode_tokens, seqs=stats.num_scheduled_seqs, waiting=stats.num_waiting,
        running=stats.num_running, kv_blocks_used=stats.kv_blocks_used, preempted=stats.num_preempted_this_step,
        kv_slots_allocated=stats.kv_slots_allocated, kv_slots_filled=stats.kv_slots_filled,
    )  # fmt: skip


def _now(last: SchedulerStats | None, totals: dict[str, int]) -> dict[str, Any]:
    if last is None:
        last = SchedulerStats()
    return {
        "waiting": last.num_waiting,
        "running": last.num_running,
        "kv_usage": last.kv_usage,
        "kv_blocks_used": last.kv_blocks_used,
        "kv_blocks_total": last.kv_blocks_total,
        "prefix_cache_hit_rate": last.prefix_cache_hit_rate,
        "preemptions_total": last.num_preemptions_total,
        **{f"{k}_total": v for k, v in totals.items()},
    }


def latency_summary(requests: Iterable[RequestPoint], window_s: float) -> dict[str, Any]:
    requests = list(requests)
    summary: dict[str, Any] = {"window_s": window_s, "count": len(requests)}
    for name in ("queue_s", "ttft_s", "tpot_s", "e2e_s"):
        values = [v for v in (getattr(r, name) for r in requests) if v is not None]
        summary[name] = {f"p{p}": percentile(values, p) for p in PERCENTILES}
    judged = [r.slo_met for r in requests if r.slo_met is not None]
    summary["slo"] = {"with_targets": len(judged), "met": sum(judged), "goodput_rps": sum(judged) / window_s}
    if any(r.adapter for r in requests):  # the dashboard's per-adapter columns (the base model as "")
        summary["by_adapter"] = by_adapter(requests)
    return summary


def by_adapter(requests: Sequence[RequestPoint]) -> dict[str, dict[str, Any]]:
    """Each adapter's finished requests (the base model's under ""): their count and TTFT / TPOT percentiles."""
    groups: dict[str, list[RequestPoint]] = {}
    for r in requests:
        groups.setdefault(r.adapter or "", []).append(r)
    out = {}
    for name, group in sorted(groups.items()):
        out[name] = {"count": len(group)}
        for field in ("ttft_s", "tpot_s"):
            values = [v for v in (getattr(r, field) for r in group) if v is not None]
            out[name][field] = {f"p{p}": percentile(values, p) for p in PERCENTILES}
    return out


def percentile(values: Sequence[float], p: float) -> float | None:
    """The p-th percentile by linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def _int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None
