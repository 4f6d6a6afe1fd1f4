"""A run's trace: every step (what was batched, KV blocks) and every request (timings); JSON and Chrome trace out.

The engine has no physical batch slots (the KV cache is paged), so `assign_lanes` gives each request a lane for as long
as it is scheduled in consecutive steps: the lowest lane free when it enters. That is what the timeline draws.
Open the Chrome trace in https://ui.perfetto.dev or chrome://tracing.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchserve.bench.metrics import RequestResult, StepSample


@dataclass
class RunTrace:
    label: str
    t0: float  # monotonic time the run started; every other time is absolute monotonic too
    max_batch_size: int
    steps: list[StepSample] = field(default_factory=list)
    requests: list[RequestResult] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunTrace:
        steps = [StepSample(**{**s, "scheduled": {k: tuple(v) for k, v in s["scheduled"].items()}}) for s in d["steps"]]
        reqs = [RequestResult(**r) for r in d["requests"]]
        return cls(d["label"], d["t0"], d["max_batch_size"], steps, reqs, d.get("meta", {}))

    def save_json(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict()))

    @classmethod
    def load_json(cls, path: str | Path) -> RunTrace:
        return cls.from_dict(json.loads(Path(path).read_text()))


Cell = tuple[str, int, bool]  # (request id, tokens this step (0: padding), is prefill)


def assign_lanes(steps: list[StepSample], num_lanes: int) -> list[dict[int, Cell]]:
    """Per step, lane -> what ran there. A request keeps its lane while scheduled in consecutive steps, and while it
    is computed as padding after finishing (static batching); padding cells have 0 tokens.

    If a step schedules more sequences than num_lanes, extra lanes are opened above num_lanes.
    """
    lane_of: dict[str, int] = {}
    out: list[dict[int, Cell]] = []
    for step in steps:
        cells = {rid: (rid, ntok, prefill) for rid, (ntok, prefill) in step.scheduled.items()}
        cells |= {rid: (rid, 0, False) for rid in step.padding}
        lane_of = {rid: lane for rid, lane in lane_of.items() if rid in cells}
        used = set(lane_of.values())
        row: dict[int, Cell] = {}
        for rid, cell in cells.items():
            if rid not in lane_of:
                lane = next(i for i in range(num_lanes + len(cells)) if i not in used)
                lane_of[rid] = lane
                used.add(lane)
            row[lane_of[rid]] = cell
        out.append(row)
    return out


def _us(t: float, t0: float) -> float:
    return round((t - t0) * 1e6, 3)


def chrome_trace(trace: RunTrace) -> dict[str, Any]:
    """Trace Event Format: one thread per batch lane (a slice per step and request), KV / queue counters, and one
    async slice per request from arrival to finish (queueing, then generating)."""
    t0 = trace.t0
    events: list[dict[str, Any]] = [
        {"ph": "M", "pid": 1, "name": "process_name", "args": {"name": f"batch lanes ({trace.label})"}},
        {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "requests"}},
    ]
    lanes = assign_lanes(trace.steps, trace.max_batch_size)
    for lane in range(max((max(row, default=-1) for row in lanes), default=-1) + 1):
        events.append({"ph": "M", "pid": 1, "tid": lane, "name": "thread_name", "args": {"name": f"slot {lane:03d}"}})
    for i, (step, row) in enumerate(zip(trace.steps, lanes, strict=True)):
        ts, dur = _us(step.start, t0), max(_us(step.end, t0) - _us(step.start, t0), 0.001)
        for lane, (rid, ntok, prefill) in row.items():
            events.append({
                "ph": "X", "pid": 1, "tid": lane, "ts": ts, "dur": dur, "name": rid,
                "cat": "prefill" if prefill else "decode" if ntok else "padding",
                "args": {"step": i, "tokens": ntok, "prefill": prefill},
            })  # fmt: skip
        events.append({
            "ph": "C", "pid": 1, "ts": ts, "name": "kv blocks",
            "args": {"used": step.kv_blocks_used, "cached": step.kv_blocks_cached_free,
                     "free": step.kv_blocks_free - step.kv_blocks_cached_free},
        })  # fmt: skip
        events.append({
            "ph": "C", "pid": 1, "ts": ts, "name": "requests",
            "args": {"running": step.num_scheduled_seqs, "waiting": step.num_waiting},
        })  # fmt: skip
    for n, r in enumerate(trace.requests):
        if r.finish_time is None:
            continue
        base = {"pid": 2, "tid": 0, "cat": "request", "id": n, "name": r.request_id}
        events.append({**base, "ph": "b", "ts": _us(r.arrival_time, t0), "args": {"prompt": r.prompt_len}})
        if r.first_token_time is not None:
            events.append({**base, "ph": "n", "ts": _us(r.first_token_time, t0), "name": "first token"})
        events.append({**base, "ph": "e", "ts": _us(r.finish_time, t0), "args": {"output": r.output_len}})
    return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"label": trace.label, **trace.meta}}


def save_chrome_trace(trace: RunTrace, path: str | Path) -> None:
    Path(path).write_text(json.dumps(chrome_trace(trace)))
