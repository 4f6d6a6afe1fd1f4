"""EngineCoreClient: the API server's engine when the engine core runs in a process of its own
(engine/core_process.py), behind the same surface as AsyncLLMEngine, so the HTTP and gRPC front ends, /metrics,
the dashboard and traces serve from it unchanged.

    client = EngineCoreClient.launch(config)   # spawns the core, waits for its model to load
    app = build_app(client)                    # as with an AsyncLLMEngine
    ...
    client.shutdown(drain=True)

Threads in this process: the event loop(s) submit (``add_request``, ``abort``); one reader thread takes the core's
messages, resolves admissions, runs the step listeners (metrics, dashboard, traces: the same contract as on the
in-process loop thread, given an ``EngineMirror`` for the engine) and hands each step's outputs to their streams.

Refusals are answered here without asking the core: a full waiting queue (as of the latest step, plus the adds on
their way) is a QueueFullError at once, so a 503 never waits for a step. The core's death (killed, crashed) is seen
by the reader within a second (host/channel.py): every stream in flight ends with EngineDeadError, new requests are
refused, and ``error`` is set, so /health answers 503.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from batchserve.config import EngineConfig
from batchserve.core.outputs import SchedulerStats
from batchserve.engine.async_engine import EngineDeadError, RequestStream, StepListener
from batchserve.engine.core_messages import (
    AbortRequests,
    AddRequests,
    Admissions,
    CoreFailed,
    CoreReady,
    DescribedEngine,
    EngineDescription,
    Shutdown,
    StepDone,
    Stopped,
)
from batchserve.engine.core_process import EngineFactory, run_engine_core
from batchserve.engine.inputs import EngineLimits
from batchserve.engine.llm_engine import LLMEngine, QueueFullError
from batchserve.host.channel import ChildProcess, PeerDeadError, start_child
from batchserve.request import EngineRequest

logger = logging.getLogger(__name__)

DEFAULT_LOAD_TIMEOUT_S = 600.0  # a model's first load may convert a GGUF file
STOP_GRACE_S = 10.0  # after Stopped (or a drain deadline), how long the core may take to exit before it is killed


class EngineCoreStartError(RuntimeError):
    """The engine core process could not build its engine (or died while loading)."""


@dataclass
class RequestView:
    """What the step listeners read of a request in the core's scheduler (serving/tracing.py)."""

    arrival_time: float
    num_prompt_tokens: int
    priority: int
    sampling_params: Any
    num_preemptions: int = 0


class EngineMirror:
    """Stands in for the LLMEngine in this process: its fixed description and its state as of the latest step."""

    def __init__(self, description: EngineDescription) -> None:
        self.config: EngineConfig = description.config
        self.limits: EngineLimits = description.limits
        self.tokenizer = description.tokenizer
        self._effective_config = description.effective_config
        self.runner = SimpleNamespace(num_kv_blocks=description.num_kv_blocks)
        self.modes = SimpleNamespace(fallback_names=description.fallback_names)
        self.scheduler = SimpleNamespace(requests={}, num_waiting=0)  # requests: id -> RequestView
        self.last_stats: SchedulerStats | None = None
        self.last_step_time_s = 0.0
        self.last_timings: Any = None
        self.num_steps = 0

    def effective_config(self) -> dict[str, Any]:
        return dict(self._effective_config)

    def observe(self, step: StepDone) -> None:
        self.last_stats, self.last_step_time_s, self.last_timings = step.stats, step.step_time_s, step.timings
        self.num_steps = step.num_steps
        if step.stats is not None:
            self.scheduler.num_waiting = step.stats.num_waiting
        for request_id, count in step.preemptions.items():
            view = self.scheduler.requests.get(request_id)
            if view is not None:
                view.num_preemptions = count


@dataclass
class _Pending:
    stream: RequestStream
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class EngineCoreClient(DescribedEngine):
    """An AsyncLLMEngine's surface over an engine core process. See the module docstring."""

    def __init__(self, child: ChildProcess, description: EngineDescription) -> None:
        self.child = child
        self.description = description
        self.engine = EngineMirror(description)
        self.step_listeners: list[StepListener] = []
        self.error: BaseException | None = None
        self._lock = threading.Lock()  # guards the dicts below and the counters (event loop vs reader thread)
        self._streams: dict[str, RequestStream] = {}
        self._pending: dict[int, _Pending] = {}
        self._seq = itertools.count()
        self._admitted_since_step = 0
        self._reader: threading.Thread | None = None
        self._stopping = False
        self._stopped = threading.Event()
        self._num_aborted_by_shutdown = 0
        self._idle = threading.Event()
        self._idle.set()
        self._last_progress = time.monotonic()

    @classmethod
    def launch(
        cls,
        config: EngineConfig | None = None,
        factory: EngineFactory = LLMEngine,
        *factory_args: Any,
        load_timeout_s: float = DEFAULT_LOAD_TIMEOUT_S,
        log_level: int = logging.INFO,
        **factory_kwargs: Any,
    ) -> EngineCoreClient:
        """Start the core process with ``factory(config, *factory_args, **factory_kwargs)`` (config omitted when
        None; the factory must be importable by name) and wait until its engine is built. EngineCoreStartError if
        it cannot be built."""
        args = (config, *factory_args) if config is not None else factory_args
        threads, seed = (config.num_threads, config.seed) if config is not None else (None, 0)
        child = start_child(run_engine_core, factory, args, factory_kwargs, threads, seed, log_level,
                            name="batchserve-engine-core")  # fmt: skip
        try:
            reply = child.channel.recv(timeout=load_timeout_s)
        except (PeerDeadError, TimeoutError) as exc:
            child.stop(timeout=1.0)
            raise EngineCoreStartError(f"the engine core process did not start: {exc}") from None
        if isinstance(reply, CoreFailed):
            child.stop(timeout=STOP_GRACE_S)
            raise EngineCoreStartError(f"the engine could not be built: {reply.error}") from reply.error
        assert isinstance(reply, CoreReady), reply
        logger.info("engine core process started (pid %d)", reply.description.pid)
        return cls(child, reply.description).start()

    # ------------------------------------------------------------------ read-only, as AsyncLLMEngine
    @property
    def tokenizer(self) -> Any:
        return self.description.tokenizer

    @property
    def core_pid(self) -> int:
        return self.description.pid

    def stats(self) -> SchedulerStats | None:
        return self.engine.last_stats

    @property
    def is_running(self) -> bool:
        return self._reader is not None and self._reader.is_alive() and self.error is None and not self._stopping

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    def stalled_for(self) -> float:
        """Seconds the core has made no progress while requests were pending (0 while it progresses or idles)."""
        return 0.0 if self._idle.is_set() else time.monotonic() - self._last_progress

    def wait_idle(self, timeout: float | None = None) -> bool:
        return self._idle.wait(timeout)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> EngineCoreClient:
        with self._lock:
            if self._reader is None:
                self._reader = threading.Thread(target=self._read, name="batchserve-core-reader", daemon=True)
                self._reader.start()
        return self

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> int:
        """As AsyncLLMEngine.shutdown: ``drain`` lets the requests in flight finish (for at most ``timeout`` s, then
        they are aborted); otherwise they are aborted now. The core process exits. Returns how many were aborted."""
        with self._lock:
            self._stopping = True
        self._tell(Shutdown(drain))
        if not self._stopped.wait(timeout) and drain:
            self._tell(Shutdown(False))
            self._stopped.wait()
        if self.child.is_alive():
            self.child.process.join(STOP_GRACE_S)
        self.child.stop(timeout=1.0)
        return self._num_aborted_by_shutdown

    def _tell(self, message: Any) -> None:
        try:
            self.child.channel.send(message)
        except PeerDeadError:
            self._stopped.wait(2.0)  # the reader reports the death (and sets _stopped) within a second

    # ------------------------------------------------------------------ event loop
    async def add_request(self, request: EngineRequest) -> RequestStream:
        """As AsyncLLMEngine.add_request: the stream of the request's deltas once the core admitted it."""
        stream = RequestStream(request, asyncio.get_running_loop())
        pending = _Pending(stream)
        with self._lock:
            if self.error is not None or self._stopping:
                raise EngineDeadError(f"engine is not running: {self.error or 'shut down'}")
            self._refuse_if_queue_full()
            seq = next(self._seq)
            self._pending[seq] = pending
            self._idle.clear()
        try:
            self.child.channel.send(AddRequests([(seq, request)]))
        except PeerDeadError as exc:
            with self._lock:
                self._pending.pop(seq, None)
            raise EngineDeadError(f"engine core process died: {exc}") from None
        try:
            await asyncio.wrap_future(pending.done)
        except asyncio.CancelledError:
            pending.done.add_done_callback(lambda done: self._abort_if_added(done, request.request_id))
            raise
        return stream

    def _abort_if_added(self, done: concurrent.futures.Future, request_id: str) -> None:
        if not done.cancelled() and done.exception() is None:
            self.abort(request_id)

    def check_capacity(self) -> None:
        """As AsyncLLMEngine.check_capacity: QueueFullError now if an add now would be refused."""
        with self._lock:
            self._refuse_if_queue_full()

    def _refuse_if_queue_full(self) -> None:
        """The waiting queue as of the core's latest step, plus what was admitted since and the adds on their way:
        answered here, never behind a step (caller holds the lock)."""
        limit = self.config.scheduler.max_waiting_requests
        if limit is None:
            return
        if self.engine.scheduler.num_waiting + self._admitted_since_step + len(self._pending) >= limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")

    def abort(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        with self._lock:
            live = [rid for rid in ids if rid in self._streams]
            streams = [self._streams.pop(rid) for rid in live]
            for rid in live:
                self.engine.scheduler.requests.pop(rid, None)
            self._update_idle()
        for rid, stream in zip(live, streams):
            stream.put(EngineDeadError(f"request {rid} aborted"))
        if live and self.error is None:
            try:
                self.child.channel.send(AbortRequests(live))
            except PeerDeadError:
                pass  # the reader ends everything within a second

    def _update_idle(self) -> None:
        if not self._streams and not self._pending:
            self._idle.set()

    # ------------------------------------------------------------------ reader thread
    def _read(self) -> None:
        try:
            while True:
                message = self.child.channel.recv()
                if isinstance(message, StepDone):
                    self._on_step(message)
                elif isinstance(message, Admissions):
                    self._on_admissions(message)
                elif isinstance(message, Stopped):
                    self._num_aborted_by_shutdown = message.num_aborted
                    self._end_all(EngineDeadError("engine shut down"), crashed=False)
                    return
                else:
                    raise TypeError(f"unexpected message from the engine core: {type(message).__name__}")
        except PeerDeadError as exc:
            if not self._stopped.is_set():
                logger.error("the engine core process died: %s", exc)
                self._end_all(EngineDeadError(f"engine core process died: {exc}"), crashed=True)
        except BaseException as exc:  # noqa: BLE001 - every waiter must hear of it
            logger.exception("engine core reader failed")
            self._end_all(EngineDeadError(f"engine core link failed: {exc!r}"), crashed=True)

    def _on_admissions(self, message: Admissions) -> None:
        settled = []
        with self._lock:
            for seq, error in message.results:
                pending = self._pending.pop(seq, None)
                if pending is None:
                    continue
                if error is None:
                    request = pending.stream.request
                    self._streams[request.request_id] = pending.stream
                    self.engine.scheduler.requests[request.request_id] = RequestView(
                        request.arrival_time, request.num_prompt_tokens, request.priority, request.sampling_params
                    )
                    self._admitted_since_step += 1
                settled.append((pending, error))
            self._update_idle()
        for pending, error in settled:
            if pending.done.set_running_or_notify_cancel():
                if error is None:
                    pending.done.set_result(None)
                else:
                    pending.done.set_exception(error)

    def _on_step(self, step: StepDone) -> None:
        deliveries = []
        with self._lock:
            self.engine.observe(step)
            self._admitted_since_step = 0
            if step.progressed:
                self._last_progress = time.monotonic()
            ended = [(self._streams.pop(rid), rid) for rid in step.aborted if rid in self._streams]
            for out in step.outputs:
                stream = self._streams.get(out.request_id)
                if stream is None:
                    continue  # aborted here meanwhile
                deliveries.append((stream, out))
                if out.finished:
                    del self._streams[out.request_id]
            self._update_idle()
        RequestStream.put_step(deliveries)
        for stream, rid in ended:  # as in-process: a request the shutdown aborted ends with an error, not a finish
            stream.put(EngineDeadError(f"request {rid} aborted"))
        for listener in self.step_listeners:
            try:
                listener(self.engine, step.outputs)
            except Exception:  # noqa: BLE001 - a broken metrics hook must not stop serving
                logger.exception("step listener failed")
        with self._lock:  # finished requests leave the mirror's scheduler after the listeners saw them
            for out in step.outputs:
                if out.finished:
                    self.engine.scheduler.requests.pop(out.request_id, None)

    def _end_all(self, dead: EngineDeadError, crashed: bool) -> None:
        with self._lock:
            if crashed:
                self.error = dead
            self._stopping = True
            streams, self._streams = list(self._streams.values()), {}
            pending, self._pending = list(self._pending.values()), {}
            self.engine.scheduler.requests.clear()
            self._idle.set()
        for entry in pending:
            if entry.done.set_running_or_notify_cancel():
                entry.done.set_exception(dead)
        for stream in streams:
            stream.put(dead)
        self._stopped.set()
