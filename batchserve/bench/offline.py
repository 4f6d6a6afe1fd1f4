"""Drive an LLMEngine in-process: add requests as they arrive, step until all are done, record every step."""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from tqdm import tqdm

from batchserve.bench.arrivals import ArrivalProcess
from batchserve.bench.metrics import RequestResult, StepSample
from batchserve.bench.trace import RunTrace
from batchserve.bench.workloads import BenchRequest


def build_engine(config: Any, like: Any = None) -> Any:
    """A new LLMEngine; given `like`, an engine whose model and KV cache fit `config`, it reuses that engine's runner
    (weights and KV tensors) so that runs differing only in scheduler options skip reloading the model."""
    from batchserve.engine.llm_engine import LLMEngine

    if like is not None and same_runner(like.config, config):
        if not like.has_unfinished_requests():
            like.step()  # an empty step tells the runner which requests finished last, so it frees their state
        return LLMEngine(config, runner=like.runner, tokenizer=like.tokenizer, model_config=like.model_config)
    return LLMEngine(config)


def same_runner(a: Any, b: Any) -> bool:
    """Configs that would build the same runner: equal except for scheduler options (other than preemption_mode)."""
    scheduler_keys = {f.name for f in dataclasses.fields(a.scheduler)} - {"preemption_mode"}
    strip = scheduler_keys | {"record_steps"}
    return {k: v for k, v in a.to_flat_dict().items() if k not in strip} == {
        k: v for k, v in b.to_flat_dict().items() if k not in strip
    }


def _sampling_params(req: BenchRequest) -> Any:
    from batchserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=req.output_len, ignore_eos=True, temperature=0.0)


def _engine_max_batch_size(engine: Any) -> int:
    try:
        return int(engine.config.scheduler.max_batch_size)
    except AttributeError:
        return int(getattr(engine.last_stats, "max_batch_size", 1) or 1)


def run_offline(
    engine: Any,
    requests: list[BenchRequest],
    arrivals: ArrivalProcess | None = None,
    seed: int = 0,
    label: str = "offline",
    progress: bool = True,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
) -> RunTrace:
    """Run the workload to completion on `engine` (anything with the LLMEngine API) and return its trace."""
    arrivals = arrivals or ArrivalProcess()
    cap = arrivals.max_concurrency
    pending = deque(sorted(zip(arrivals.offsets(len(requests), seed), requests, strict=True), key=lambda p: p[0]))
    base = engine.last_stats
    base_q, base_h = getattr(base, "prefix_cache_queries", 0), getattr(base, "prefix_cache_hits", 0)
    live: dict[str, RequestResult] = {}
    done: list[RequestResult] = []
    steps: list[StepSample] = []
    bar = tqdm(total=len(requests), desc=label, unit="req", disable=not progress, leave=False)
    t0 = clock()
    prev_stats = base
    while pending or live:
        now = clock()
        while pending and pending[0][0] <= now - t0 and (cap is None or len(live) < cap):
            offset, req = pending.popleft()
            result = _add(engine, req, t0 + offset if cap is None else max(t0 + offset, now))
            if result.success:
                live[req.request_id] = result
            else:
                done.append(result)
                bar.update(1)
        if not live:
            if pending:
                sleep(max(0.0, pending[0][0] - (clock() - t0)))
            continue
        start = clock()
        outputs = engine.step()
        end = clock()
        finished = _record_outputs(outputs, live, done, end, bar)
        stats = engine.last_stats
        if stats is not None and stats is not prev_stats and getattr(stats, "num_scheduled_seqs", 1):
            sample = StepSample.from_stats(start, end, stats, finished)
            sample.prefix_cache_queries -= base_q
            sample.prefix_cache_hits -= base_h
            steps.append(sample)
        prev_stats = stats
    bar.close()
    duration = clock() - t0
    order = {r.request_id: i for i, r in enumerate(requests)}
    done.sort(key=lambda r: order[r.request_id])
    meta = {"duration_s": duration, "target": "offline", "arrivals": arrivals.describe()}
    return RunTrace(label, t0, _engine_max_batch_size(engine), steps, done, meta)


def _add(engine: Any, req: BenchRequest, arrival: float) -> RequestResult:
    result = RequestResult(req.request_id, req.prompt_len, 0, arrival, category=req.category)
    try:
        engine.add_request(req.request_id, req.prompt_token_ids, _sampling_params(req), arrival_time=arrival)
    except Exception as exc:  # noqa: BLE001 - InvalidRequestError, QueueFullError: record the failure, go on
        result.success, result.error = False, f"{type(exc).__name__}: {exc}"
    return result


def _record_outputs(outputs: list[Any], live: dict[str, RequestResult], done: list, now: float, bar: Any) -> list[str]:
    finished = []
    for out in outputs:
        result = live.get(out.request_id)
        if result is None:
            continue
        if out.delta_token_ids:
            result.token_times.append(now)
        if not out.finished:
            continue
        m = out.metrics
        result.output_len = len(out.token_ids)
        result.first_token_time = getattr(m, "first_token_time", None) or (result.token_times or [None])[0]
        result.finish_time = getattr(m, "finished_time", None) or now
        result.num_cached_tokens = getattr(m, "num_cached_tokens", 0) or 0
        result.num_preemptions = getattr(m, "num_preemptions", 0) or 0
        if str(getattr(out.finish_reason, "value", out.finish_reason)) == "abort":
            result.success, result.error = False, "aborted"
        finished.append(out.request_id)
        done.append(live.pop(out.request_id))
        bar.update(1)
    return finished
