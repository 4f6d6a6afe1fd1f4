"""What doctor reads: a window of engine steps and finished requests, from a live server's /dashboard/data (polled
over the window) or from a bench trace file, in one shape (Observation) that the rules measure."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchserve.bench.trace import RunTrace
from batchserve.serving.live_stats import percentile

POLL_INTERVAL_S = 1.0


class SourceError(RuntimeError):
    """The server or the trace file could not be read."""


@dataclass
class Step:
    duration_s: float
    prefill_tokens: int
    decode_tokens: int
    seqs: int
    waiting: int
    running: int
    kv_blocks_used: int
    preempted: int
    kv_slots_allocated: int = 0
    kv_slots_filled: int = 0

    @property
    def tokens(self) -> int:
        return self.prefill_tokens + self.decode_tokens


@dataclass
class Finished:
    prompt_tokens: int
    output_tokens: int
    arrival_time: float
    ttft_s: float | None
    e2e_s: float
    preemptions: int = 0


@dataclass
class Observation:
    """A window of one engine's life. `config`: the effective configuration (max_batch_size, max_num_tokens,
    block_size, num_kv_blocks, ...); in_flight_*: waiting + running at the window's ends."""

    duration_s: float
    config: dict[str, Any]
    steps: list[Step] = field(default_factory=list)
    requests: list[Finished] = field(default_factory=list)
    in_flight_start: int = 0
    in_flight_end: int = 0
    waiting_start: int = 0
    waiting_end: int = 0

    def knob(self, name: str, default: int = 0) -> int:
        try:
            return int(self.config.get(name, default))
        except (TypeError, ValueError):
            return default

    # ---- measures the rules read
    @property
    def busy_share(self) -> float:
        return min(1.0, sum(s.duration_s for s in self.steps) / self.duration_s) if self.duration_s else 0.0

    @property
    def arrival_rate(self) -> float:
        arrived = len(self.requests) + self.in_flight_end - self.in_flight_start
        return max(0, arrived) / self.duration_s if self.duration_s else 0.0

    @property
    def completion_rate(self) -> float:
        return len(self.requests) / self.duration_s if self.duration_s else 0.0

    @property
    def output_throughput(self) -> float:
        return sum(r.output_tokens for r in self.requests) / self.duration_s if self.duration_s else 0.0

    def share_of_steps(self, predicate: Callable[[Step], bool], steps: Sequence[Step] | None = None) -> float:
        steps = self.steps if steps is None else steps
        return sum(1 for s in steps if predicate(s)) / len(steps) if steps else 0.0

    def mean(self, values: Sequence[float]) -> float:
        return sum(values) / len(values) if values else 0.0

    @property
    def kv_usage_peak(self) -> float:
        total = self.knob("num_kv_blocks")
        return max((s.kv_blocks_used for s in self.steps), default=0) / total if total else 0.0

    @property
    def fragmentation(self) -> float:
        """Share of the allocated KV slots that hold no token (the tails of the last blocks)."""
        allocated = sum(s.kv_slots_allocated for s in self.steps)
        return 1.0 - sum(s.kv_slots_filled for s in self.steps) / allocated if allocated else 0.0

    @property
    def preemptions(self) -> int:
        return sum(s.preempted for s in self.steps)

    def latency(self, name: str, p: float) -> float | None:
        return percentile([v for v in (getattr(r, name) for r in self.requests) if v is not None], p)

    def prompt_len(self, p: float) -> float:
        return percentile([r.prompt_tokens for r in self.requests], p) or 0.0


# ---------------------------------------------------------------------- from a live server
def _step(row: dict[str, Any]) -> Step:
    names = Step.__dataclass_fields__
    return Step(**{k: v for k, v in row.items() if k in names})


def _finished(row: dict[str, Any]) -> Finished:
    names = Finished.__dataclass_fields__
    return Finished(**{k: v for k, v in row.items() if k in names})


def watch(fetch: Callable[[int, float], dict[str, Any]], window_s: float, sleep: Callable[[float], None] = time.sleep,
          clock: Callable[[], float] = time.monotonic) -> Observation:  # fmt: skip
    """Poll `fetch(since_step, finished_after)` (a /dashboard/data snapshot with requests) for `window_s` seconds:
    every step after the first poll, every request that finished after it."""
    first = fetch(-1, 0.0)
    # the engine's finish times, not this clock, mark what was seen: a request finished after the latest of them is new
    after = max((r["finished_time"] for r in first.get("requests", [])), default=0.0)
    start, since = clock(), _last_index(first, -1)
    obs = Observation(0.0, first["config"], in_flight_start=_in_flight(first), waiting_start=first["now"]["waiting"])
    while True:
        remaining = window_s - (clock() - start)
        if remaining <= 0:
            break
        sleep(min(POLL_INTERVAL_S, remaining))
        snap = fetch(since, after)
        fields = snap["step_fields"]
        obs.steps += [_step(dict(zip(fields, row))) for row in snap["steps"]]
        since = _last_index(snap, since)
        fresh = snap.get("requests", [])
        after = max([after, *(r["finished_time"] for r in fresh)])
        obs.requests += [_finished(r) for r in fresh]
        obs.in_flight_end, obs.waiting_end = _in_flight(snap), snap["now"]["waiting"]
    obs.duration_s = clock() - start
    return obs


def _last_index(snap: dict[str, Any], since: int) -> int:
    if not snap["steps"]:
        return since
    return snap["steps"][-1][snap["step_fields"].index("index")]


def _in_flight(snap: dict[str, Any]) -> int:
    return snap["now"]["waiting"] + snap["now"]["running"]


def http_fetcher(url: str, api_key: str | None = None) -> Callable[[int, float], dict[str, Any]]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def fetch(since: int, finished_after: float) -> dict[str, Any]:
        params = {"since": since, "requests": True, "finished_after": finished_after}
        try:
            response = httpx.get(f"{url.rstrip('/')}/dashboard/data", params=params, headers=headers, timeout=10)
            response.raise_for_status()
            return response.json()
        except (httpx.HTTPError, ValueError) as exc:
            raise SourceError(f"cannot read {url}/dashboard/data: {exc}") from exc

    return fetch


# ---------------------------------------------------------------------- from a bench trace
def from_trace_file(path: str | Path) -> Observation:
    """A bench trace (`batchserve bench --trace-json`): its steps and requests; the configuration from its meta."""
    try:
        trace = RunTrace.from_dict(json.loads(Path(path).read_text()))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise SourceError(f"cannot read the bench trace {path}: {exc!r}") from exc
    config = dict(trace.meta.get("config") or trace.meta.get("engine_config") or {})
    config.setdefault("max_batch_size", trace.max_batch_size)
    if trace.steps:
        config.setdefault("num_kv_blocks", trace.steps[0].kv_blocks_total)
    steps = [
        Step(s.end - s.start, s.num_prefill_tokens, s.num_decode_tokens, s.num_scheduled_seqs, s.num_waiting,
             s.num_running, s.kv_blocks_used, s.num_preempted)
        for s in trace.steps
    ]  # fmt: skip
    requests = [
        Finished(r.prompt_len, r.output_len, r.arrival_time, r.ttft, r.e2e if r.e2e is not None else math.nan,
                 r.num_preemptions or 0)
        for r in trace.requests if r.success and r.e2e is not None
    ]  # fmt: skip
    duration = trace.meta.get("duration_s") or (
        max((r.finish_time or 0.0) for r in trace.requests) - trace.t0 if trace.requests else 0.0
    )
    return Observation(float(duration), config, steps, requests)
