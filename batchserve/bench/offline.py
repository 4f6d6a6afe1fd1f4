"""Drive an LLMEngine in-process: add requests as they arrive, step until all are done, record every step."""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from tqdm import tqdm

from batchserve.bench.arrivals import ArrivalProcess
from batchserve.bench.metrics import CUMULATIVE_COUNTERS, RequestResult, StepSample
from batchserve.bench.trace import RunTrace
from batchserve.bench.workloads import BenchRequest


def build_engine(config: Any, like: Any = None, share_runner: bool = True, **engine_kwargs: Any) -> Any:
    """A new LLMEngine; given `like`, an engine whose model and KV cache fit `config`, it reuses that engine's model
    so that runs differing only in scheduler options skip reloading it: its whole runner (weights and KV tensors) when
    `share_runner` (the runs then take turns), else a runner of its own (own KV pool) around the same weights (runs
    that step alternately). `engine_kwargs` go to LLMEngine (its clock)."""
    from batchserve.engine.llm_engine import LLMEngine

    if like is not None and same_runner(like.config, config):
        if not share_runner:
            r = like.runner
            runner = type(r)(config, like.model_config, r.model, r.device, r.dtype)
        else:
            if not like.has_unfinished_requests():
                like.step()  # an empty step tells the runner which requests finished last, so it frees their state
            runner = like.runner
        return LLMEngine(config, runner=runner, tokenizer=like.tokenizer, model_config=like.model_config,
                         **engine_kwargs)  # fmt: skip
    return LLMEngine(config, **engine_kwargs)


def same_runner(a: Any, b: Any) -> bool:
    """Configs that would build the same runner: equal except for scheduler options (other than preemption_mode)."""
    scheduler_keys = {f.name for f in dataclasses.fields(a.scheduler)} - {"preemption_mode"}
    strip = scheduler_keys | {"record_steps"}
    return {k: v for k, v in a.to_flat_dict().items() if k not in strip} == {
        k: v for k, v in b.to_flat_dict().items() if k not in strip
    }


def _sampling_params(req: BenchRequest) -> Any:
    from batchserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=req.output_len, ignore_eos=req.ignore_eos, temperature=0.0,
                          ttft_slo_ms=req.ttft_slo_ms, tpot_slo_ms=req.tpot_slo_ms)  # fmt: skip


def _engine_max_batch_size(engine: Any) -> int:
    try:
        return int(engine.config.scheduler.max_batch_size)
    except AttributeError:
        return int(getattr(engine.last_stats, "max_batch_size", 1) or 1)


class BusyClock:
    """A clock that runs only while its run works (inside `busy()`) or idles on purpose (`sleep`, which returns at
    once). Runs stepped alternately in one process (`run_lockstep`) each see only their own steps' time, so a change
    of the host's load affects them alike instead of whichever ran second."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._elapsed = 0.0
        self._since: float | None = None

    def __call__(self) -> float:
        return self._elapsed + (0.0 if self._since is None else self._clock() - self._since)

    @contextlib.contextmanager
    def busy(self) -> Iterator[None]:
        self._since = self._clock()
        try:
            yield
        finally:
            self._elapsed += self._clock() - self._since
            self._since = None

    def sleep(self, seconds: float) -> None:
        self._elapsed += max(0.0, seconds)


class OfflineRun:
    """One workload on one engine: `advance()` admits the requests that are due and runs one engine step."""

    def __init__(
        self,
        engine: Any,
        requests: list[BenchRequest],
        arrivals: ArrivalProcess | None = None,
        seed: int = 0,
        label: str = "offline",
        progress: bool = True,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] | None = None,
        bar: Any = None,
        on_result: Callable[[RequestResult], None] | None = None,
    ) -> None:
        """sleep: how to wait for the next arrival; default time.sleep, or a BusyClock's own (virtual) sleep.
        bar: a progress bar shared with other runs (lockstep runs draw one bar, not one each); on_result: called with
        each request as it finishes (the partial-results log)."""
        self.engine, self.requests, self.label = engine, requests, label
        self.arrivals = arrivals or ArrivalProcess()
        busy = isinstance(clock, BusyClock)
        self.clock = clock
        self.sleep = sleep or (clock.sleep if busy else time.sleep)
        self._arrival_to_engine = not busy  # a busy clock is not the engine's: the engine then stamps arrivals
        self.pending = deque(
            sorted(zip(self.arrivals.offsets(len(requests), seed), requests, strict=True), key=lambda p: p[0])
        )
        base = engine.last_stats
        self._baseline = {name: getattr(base, name, 0) for name in CUMULATIVE_COUNTERS}
        self._prev_stats = base
        self.live: dict[str, RequestResult] = {}
        self.done: list[RequestResult] = []
        self.steps: list[StepSample] = []
        self._own_bar = bar is None
        self.bar = bar if bar is not None else tqdm(total=len(requests), desc=label, unit="req", disable=not progress)
        self.on_result = on_result or (lambda result: None)
        self.t0 = clock()

    @property
    def finished(self) -> bool:
        return not self.pending and not self.live

    def advance(self) -> None:
        cap = self.arrivals.max_concurrency
        now = self.clock()
        while self.pending and self.pending[0][0] <= now - self.t0 and (cap is None or len(self.live) < cap):
            offset, req = self.pending.popleft()
            result = self._add(req, self.t0 + offset if cap is None else max(self.t0 + offset, now))
            if result.success:
                self.live[req.request_id] = result
            else:
                self.done.append(result)
                self.on_result(result)
                self.bar.update(1)
        if not self.live:
            if self.pending:
                self.sleep(max(0.0, self.pending[0][0] - (self.clock() - self.t0)))
            return
        start = self.clock()
        outputs = self.engine.step()
        end = self.clock()
        finished = _record_outputs(outputs, self.live, self.done, end, self.bar)
        for result in self.done[len(self.done) - len(finished) :]:
            self.on_result(result)
        stats = self.engine.last_stats
        if stats is not None and stats is not self._prev_stats and getattr(stats, "num_scheduled_seqs", 1):
            sample = StepSample.from_stats(start, end, stats, finished)
            for name, value in self._baseline.items():
                setattr(sample, name, getattr(sample, name) - value)
            self.steps.append(sample)
        self._prev_stats = stats

    def _add(self, req: BenchRequest, arrival: float) -> RequestResult:
        result = RequestResult(req.request_id, req.prompt_len, 0, arrival, category=req.category)
        try:
            self.engine.add_prompt(
                req.request_id, req.prompt_token_ids, _sampling_params(req),
                arrival_time=arrival if self._arrival_to_engine else None,
            )  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - InvalidRequestError, QueueFullError: record the failure, go on
            result.success, result.error = False, f"{type(exc).__name__}: {exc}"
        return result

    def trace(self) -> RunTrace:
        if self._own_bar:
            self.bar.close()
        duration = self.clock() - self.t0
        order = {r.request_id: i for i, r in enumerate(self.requests)}
        self.done.sort(key=lambda r: order[r.request_id])
        meta = {"duration_s": duration, "target": "offline", "arrivals": self.arrivals.describe()}
        return RunTrace(self.label, self.t0, _engine_max_batch_size(self.engine), self.steps, self.done, meta)


def run_offline(engine: Any, requests: list[BenchRequest], *args: Any, **kwargs: Any) -> RunTrace:
    """Run the workload to completion on `engine` (anything with the LLMEngine API) and return its trace; further
    arguments as OfflineRun's."""
    return drive(OfflineRun(engine, requests, *args, **kwargs))


def drive(run: OfflineRun) -> RunTrace:
    while not run.finished:
        run.advance()
    return run.trace()


def run_lockstep(runs: list[OfflineRun]) -> list[RunTrace]:
    """Step the runs alternately (one engine step each in turn) until all are done. Give each its own BusyClock:
    every run's durations and latencies then count only its own steps."""
    clocks = [run.clock for run in runs]
    if not all(isinstance(c, BusyClock) for c in clocks) or len({id(c) for c in clocks}) != len(clocks):
        raise ValueError("run_lockstep needs one BusyClock per run")
    while not all(run.finished for run in runs):
        for run in runs:
            if not run.finished:
                with run.clock.busy():
                    run.advance()
    return [run.trace() for run in runs]


def _record_outputs(outputs: list[Any], live: dict[str, RequestResult], done: list, now: float, bar: Any) -> list[str]:
    finished = []
    for out in outputs:
        result = live.get(out.request_id)
        if result is None:
            continue
        if out.delta_token_ids:
            result.token_times.append(now)
            result.output_len += len(out.delta_token_ids)  # outputs carry deltas: counted here, not sliced
        if not out.finished:
            continue
        m = out.metrics
        # the driver's clock, not the engine's (a lockstep run's clock is not the engine's)
        result.first_token_time = (result.token_times or [now])[0]
        result.finish_time = now
        result.num_cached_tokens = getattr(m, "num_cached_tokens", 0) or 0
        result.num_preemptions = getattr(m, "num_preemptions", 0) or 0
        if str(getattr(out.finish_reason, "value", out.finish_reason)) == "abort":
            result.success, result.error = False, "aborted"
        finished.append(out.request_id)
        done.append(live.pop(out.request_id))
        bar.update(1)
    return finished
