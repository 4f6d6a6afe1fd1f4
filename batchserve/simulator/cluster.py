"""Drive simulated replicas through a workload in virtual time: arrivals are routed as they fall due, and each replica
steps whenever its previous step has ended (replicas run concurrently, each on its own virtual clock). The same
events and records as bench/offline.py's driver: requests are admitted before a step that starts at or after their
arrival, tokens are delivered at the end of the step that sampled them."""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from batchserve.bench.arrivals import ArrivalProcess
from batchserve.bench.metrics import RequestResult, StepSample
from batchserve.bench.trace import RunTrace
from batchserve.bench.workloads import BenchRequest
from batchserve.core.slo import SloUnattainableError
from batchserve.sampling_params import InvalidRequestError, SamplingParams
from batchserve.simulator.engine import SimEngine


@dataclass
class Replica:
    engine: SimEngine
    index: int
    steps: list[StepSample] = field(default_factory=list)
    live: dict[str, RequestResult] = field(default_factory=dict)
    ready_at: float = 0.0  # when its current step ends: it can start the next one then

    @property
    def num_unfinished(self) -> int:
        return self.engine.num_unfinished


@dataclass
class ClusterResult:
    trace: RunTrace  # every request and every replica's steps
    replicas: list[RunTrace]  # one per replica (timeline and KV pictures are per engine)
    routed: list[int]  # requests routed to each replica
    assignment: dict[str, int]  # request id -> the replica it was routed to


class Cluster:
    def __init__(self, engines: list[SimEngine], router: object) -> None:
        self.replicas = [Replica(e, i) for i, e in enumerate(engines)]
        self.router = router
        self._prefix = [(0, 0)] * len(engines)  # each replica's cumulative (queries, hits)
        self.assignment: dict[str, int] = {}
        self.lora_adapters = 0  # requests spread round-robin over this many adapters (ids 1..n); 0: none
        self._lora_of: dict[str, int] = {}
        self._freed_at = 0.0  # end of the latest step that finished a request (a closed loop sends the next then)

    def run(self, requests: list[BenchRequest], arrivals: ArrivalProcess | None = None, seed: int = 0,
            label: str = "simulated") -> ClusterResult:  # fmt: skip
        arrivals = arrivals or ArrivalProcess()
        n = self.lora_adapters
        self._lora_of = {r.request_id: i % n + 1 for i, r in enumerate(requests)} if n else {}
        pending = deque(sorted(zip(arrivals.offsets(len(requests), seed), requests, strict=True), key=lambda p: p[0]))
        cap = arrivals.max_concurrency or math.inf
        done: list[RequestResult] = []
        routed = [0] * len(self.replicas)
        now = 0.0
        while True:
            busy = [r for r in self.replicas if r.engine.has_unfinished_requests()]
            live = sum(len(r.live) for r in self.replicas)
            nxt = min(busy, key=lambda r: (r.ready_at, r.index)) if busy else None
            if pending and live < cap and (nxt is None or max(pending[0][0], now) <= nxt.ready_at):
                offset, req = pending.popleft()
                now = max(now, offset, self._freed_at if live >= 1 and cap < math.inf else 0.0)
                routed[self._admit(req, now, done)] += 1
                continue
            if nxt is None:
                break
            now = max(now, nxt.ready_at)
            self._step(nxt, now, done)
        order = {r.request_id: i for i, r in enumerate(requests)}
        done.sort(key=lambda r: order[r.request_id])
        duration = max([now, *(r.finish_time or 0.0 for r in done)])
        steps = sorted((s for r in self.replicas for s in r.steps), key=lambda s: (s.start, s.end))
        mbs = sum(r.engine.config.scheduler.max_batch_size for r in self.replicas)
        meta = {"duration_s": duration, "target": "simulated", "arrivals": arrivals.describe(),
                "replicas": len(self.replicas)}  # fmt: skip
        per = [self._replica_trace(r, done, f"{label}/r{r.index}", meta) for r in self.replicas]
        trace = RunTrace(label, 0.0, mbs if len(self.replicas) > 1 else per[0].max_batch_size, steps, done, meta)
        return ClusterResult(trace, per, routed, dict(self.assignment))

    def _admit(self, req: BenchRequest, now: float, done: list[RequestResult]) -> int:
        index = self.router.route(req.prompt_token_ids, self.replicas) if len(self.replicas) > 1 else 0
        rep = self.replicas[index]
        self.assignment[req.request_id] = index
        rep.engine.clock.advance_to(now)
        rep.ready_at = max(rep.ready_at, now)
        result = RequestResult(req.request_id, req.prompt_len, 0, now, category=req.category)
        params = SamplingParams(max_tokens=req.output_len, ignore_eos=True, temperature=0.0,
                                ttft_slo_ms=req.ttft_slo_ms, tpot_slo_ms=req.tpot_slo_ms)  # fmt: skip
        try:
            lora_id = self._lora_of.get(req.request_id, 0)
            rep.engine.add_request(req.request_id, req.prompt_token_ids, params, arrival_time=now, lora_id=lora_id)
            rep.live[req.request_id] = result
        except (InvalidRequestError, SloUnattainableError) as exc:
            result.success, result.error = False, f"{type(exc).__name__}: {exc}"
            done.append(result)
        return index

    def _step(self, rep: Replica, now: float, done: list[RequestResult]) -> None:
        engine = rep.engine
        engine.clock.advance_to(now)
        start = engine.clock()
        outputs = engine.step()
        if engine.clock() == start and engine.last_stats is not None and not engine.last_stats.num_scheduled_seqs:
            engine.clock.advance(1e-3)  # nothing could run (waiting on blocks): let time pass instead of spinning
        end = rep.ready_at = engine.clock()
        finished = []
        for out in outputs:
            result = rep.live.get(out.request_id)
            if result is None:
                continue
            if out.delta_token_ids:
                result.token_times.append(end)
            if out.finished:
                result.output_len = len(out.token_ids)
                result.first_token_time = (result.token_times or [end])[0]
                result.finish_time = end
                result.num_cached_tokens = out.metrics.num_cached_tokens
                result.num_preemptions = out.metrics.num_preemptions
                if out.finish_reason == "abort":
                    result.success, result.error = False, "aborted"
                finished.append(out.request_id)
                done.append(rep.live.pop(out.request_id))
        if finished:
            self._freed_at = end
        stats = engine.last_stats
        if stats is not None and stats.num_scheduled_seqs:
            self._prefix[rep.index] = (stats.prefix_cache_queries, stats.prefix_cache_hits)
            sample = StepSample.from_stats(start, end, stats, finished)
            sample.prefix_cache_queries = sum(q for q, _ in self._prefix)  # cluster-wide, as the report reads it
            sample.prefix_cache_hits = sum(h for _, h in self._prefix)
            rep.steps.append(sample)

    @staticmethod
    def _replica_trace(rep: Replica, done: list[RequestResult], label: str, meta: dict) -> RunTrace:
        ids = {s_id for s in rep.steps for s_id in s.scheduled}
        return RunTrace(label, 0.0, rep.engine.config.scheduler.max_batch_size, rep.steps,
                        [r for r in done if r.request_id in ids], dict(meta))  # fmt: skip
