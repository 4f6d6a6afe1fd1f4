"""The simulator asked what a knob would change: the observed requests' lengths replayed at the observed arrival rate
on the real scheduler in virtual time, once as configured and once with the change; the step time fitted to the
observed steps (a fixed cost per step, per token, per sequence), or taken from a measured profile."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Any

from batchserve.bench.arrivals import ArrivalProcess
from batchserve.bench.metrics import SLO, summarize
from batchserve.bench.workloads import BenchRequest
from batchserve.config import EngineConfig
from batchserve.doctor.observe import Observation
from batchserve.simulator.clock import VirtualClock
from batchserve.simulator.cluster import Cluster
from batchserve.simulator.engine import SimEngine
from batchserve.simulator.router import make_router
from batchserve.simulator.shape import StepShape
from batchserve.simulator.step_model import LinearStepModel, StepTimeModel, fit_linear

# the knobs a prediction carries over from the server's effective configuration
SCHEDULING_KNOBS = ("max_batch_size", "max_num_tokens", "block_size", "num_kv_blocks", "scheduler_policy",
                    "scheduling_order", "enable_chunked_prefill", "preemption_mode", "max_input_len",
                    "long_prefill_token_threshold", "max_num_partial_prefills", "max_long_partial_prefills",
                    "ttft_slo_ms", "tpot_slo_ms", "slo_admission")  # fmt: skip
MAX_REPLAYED = 300  # requests per simulated run: enough for a p99, seconds of simulation
MIN_STEPS_TO_FIT = 8


@dataclass
class Prediction:
    change: dict[str, Any]  # knob -> new value
    current: dict[str, Any]  # knob -> its value now
    before: dict[str, float]  # output_tok_s, ttft_p99_ms, e2e_p99_ms, preemptions
    after: dict[str, float]

    def describe(self) -> str:
        knobs = ", ".join(f"{k} {self.current.get(k)} -> {v}" for k, v in self.change.items())
        parts = [f"{knobs}: throughput {_rel(self.before['output_tok_s'], self.after['output_tok_s'])}"]
        for key, label in (("ttft_p99_ms", "TTFT p99"), ("e2e_p99_ms", "e2e p99")):
            parts.append(f"{label} {self.before[key]:.0f} -> {self.after[key]:.0f} ms")
        if "slo_attainment" in self.before and "slo_attainment" in self.after:
            parts.append(f"requests meeting the SLO {100 * self.before['slo_attainment']:.0f}% -> "
                         f"{100 * self.after['slo_attainment']:.0f}%")  # fmt: skip
        if self.before["preemptions"] or self.after["preemptions"]:
            parts.append(f"preemptions {self.before['preemptions']:.0f} -> {self.after['preemptions']:.0f}")
        return ", ".join(parts) + " (predicted by the simulator)"


def _rel(before: float, after: float) -> str:
    return f"{100 * (after / before - 1):+.0f}%" if before else "n/a"


def step_model_of(obs: Observation) -> StepTimeModel | None:
    """A step time fitted to the window's steps (None with too few): seconds = a + b tokens + c seqs."""
    steps = [s for s in obs.steps if s.duration_s > 0]
    if len(steps) < MIN_STEPS_TO_FIT:
        return None
    shapes = [StepShape(tokens=s.tokens, seqs=s.seqs) for s in steps]
    model, _ = fit_linear(shapes, [s.duration_s for s in steps], knots=(), folds=2)
    return model if isinstance(model, LinearStepModel) else None


def engine_config(obs: Observation, change: dict[str, Any]) -> EngineConfig:
    options = {k: obs.config[k] for k in SCHEDULING_KNOBS if obs.config.get(k) not in (None, "", "None")}
    options = {k: _parse(v) for k, v in options.items()} | change
    options["max_model_len"] = int(obs.config.get("max_model_len") or 0) or None
    options.pop("max_input_len", None)  # follows max_model_len
    return EngineConfig.from_options(**{k: v for k, v in options.items() if v is not None})


def _parse(value: Any) -> Any:
    if isinstance(value, str):
        if value in ("True", "False"):
            return value == "True"
        try:
            return int(value)
        except ValueError:
            return value
    return value


@dataclass
class BacklogArrivals(ArrivalProcess):
    """The requests the server already held when the window opened (waiting or running) arrive at once at t=0, the
    rest at the observed rate after them: a server found backed up starts its replay backed up, so the TTFT it
    predicts counts the queue, not only the arrivals seen while watching."""

    backlog: int = field(default=0, kw_only=True)

    def offsets(self, n: int, seed: int = 0) -> list[float]:
        held = min(self.backlog, n)
        return [0.0] * held + super().offsets(n - held, seed) if n > held else [0.0] * n


def replay_requests(obs: Observation, seed: int = 0) -> list[BenchRequest]:
    """The backlog the window opened with, then as many requests as arrived in the window (not only those that
    finished: an overloaded window finishes fewer), their lengths drawn from the finished ones'; at most
    MAX_REPLAYED."""
    rng = random.Random(seed)
    arrived = round(obs.arrival_rate * obs.duration_s) + obs.in_flight_start
    count = min(MAX_REPLAYED, max(len(obs.requests), arrived))
    picked = [obs.requests[i % len(obs.requests)] for i in range(len(obs.requests))]
    picked += [rng.choice(obs.requests) for _ in range(count - len(picked))]
    rng.shuffle(picked)
    return [
        BenchRequest(
            f"r{i}", [rng.randrange(1, 30000) for _ in range(max(1, r.prompt_tokens))], max(1, r.output_tokens)
        )
        for i, r in enumerate(picked[:count])
    ]


def simulate(obs: Observation, model: StepTimeModel, change: dict[str, Any], seed: int = 0) -> dict[str, float]:
    """`change` may hold `replicas` (engines behind a least-loaded router) besides engine options."""
    change = dict(change)
    replicas = int(change.pop("replicas", 1))
    config = engine_config(obs, change)
    blocks = int(config.cache.num_kv_blocks or obs.knob("num_kv_blocks", 1024))
    if "block_size" in change and "num_kv_blocks" not in change:  # the same memory in blocks of the new size
        blocks = blocks * obs.knob("block_size", 16) // config.cache.block_size
    max_model_len = config.scheduler.max_model_len or blocks * config.cache.block_size
    engines = [SimEngine(config, model, blocks, max_model_len, VirtualClock()) for _ in range(replicas)]
    router = make_router("least-loaded" if replicas > 1 else "round-robin", replicas, config.cache.block_size, blocks)
    cluster = Cluster(engines, router)
    rate = obs.arrival_rate if obs.arrival_rate > 0 else float("inf")
    arrivals = BacklogArrivals(request_rate=rate, backlog=obs.in_flight_start)
    result = cluster.run(replay_requests(obs, seed), arrivals, seed=seed)
    slo = slo_of(config)
    summary = summarize(result.trace.requests, result.trace.meta["duration_s"], slo)
    outcome = {
        "output_tok_s": summary["output_throughput"],
        "ttft_p99_ms": summary["ttft_ms"]["p99"] or 0.0,
        "e2e_p99_ms": summary["e2e_ms"]["p99"] or 0.0,
        "preemptions": float(sum(r.num_preemptions or 0 for r in result.trace.requests)),
    }
    if slo is not None:  # requests refused by SLO admission count as missed: goodput is over all that arrived
        outcome["slo_attainment"] = summary["slo_attainment"]
    return outcome


def slo_of(config: EngineConfig) -> SLO | None:
    ttft, tpot = config.scheduler.ttft_slo_ms, config.scheduler.tpot_slo_ms
    if not ttft and not tpot:
        return None
    return SLO(ttft / 1000 if ttft else math.inf, tpot / 1000 if tpot else math.inf)


def predict(obs: Observation, change: dict[str, Any], model: StepTimeModel | None = None) -> Prediction | None:
    """The simulated effect of `change` (knob -> new value); None when the window has too little to go on."""
    model = model or step_model_of(obs)
    if model is None or not obs.requests:
        return None
    current = {k: obs.config.get(k, 1 if k == "replicas" else None) for k in change}
    return Prediction(change, current, simulate(obs, model, {}), simulate(obs, model, change))
