"""The engine loop in its own thread, and an asyncio front door to it.

``LLMEngine`` is not thread safe, so exactly one thread — the loop thread started here — ever calls its
``add_request`` / ``abort_request`` / ``step``. Other threads (the asyncio event loop of the HTTP server) hand in
commands through a deque guarded by a Condition; the loop sleeps on that Condition when there is nothing to do.
Outputs go back through one ``asyncio.Queue`` per request, fed with ``loop.call_soon_threadsafe`` as soon as a step
has produced them, so each token can be streamed the moment it is sampled.

    async_engine = AsyncLLMEngine(engine).start()
    async for out in async_engine.generate("Hello", SamplingParams(max_tokens=8)):  # a CompletionDelta per step
        print(out.delta_text, end="")
    async_engine.shutdown()
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from batchserve.config import EngineConfig
from batchserve.core.outputs import SchedulerStats
from batchserve.engine.errors import EngineDeadError, QueueFullError
from batchserve.engine.inputs import EngineLimits, Prompt
from batchserve.engine.llm_engine import LLMEngine
from batchserve.engine.outputs import CompletionDelta
from batchserve.host.process import adopt_torch_threads, release_openmp_workers
from batchserve.request import EngineRequest, LoRARequest
from batchserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

IDLE_STEP_PAUSE_S = 0.005

StepListener = Callable[[LLMEngine, list[CompletionDelta]], None]  # called on the loop thread after each step


class RequestStream:
    """Outputs of one request, delivered to the event loop that asked for it."""

    def __init__(self, request: EngineRequest, loop: asyncio.AbstractEventLoop) -> None:
        self.request = request
        self.request_id = request.request_id
        self._loop = loop
        self._queue: asyncio.Queue[CompletionDelta | BaseException] = asyncio.Queue()
        self._held_error: BaseException | None = None  # met by ready() behind outputs; raised by the next call
        self.finished = False
        self.listener: Callable[[], None] | None = None  # called on the event loop after each delivery

    # loop thread
    def put(self, item: CompletionDelta | BaseException) -> None:
        _call_soon(self._loop, self._deliver, item)

    @staticmethod
    def put_step(deliveries: list[tuple[RequestStream, CompletionDelta]]) -> None:
        """One engine step's outputs, each to its stream: one wake-up of each event loop for all of them (and a
        listener sees the whole step at once)."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, CompletionDelta]]] = {}
        for stream, out in deliveries:
            by_loop.setdefault(stream._loop, []).append((stream, out))
        for loop, items in by_loop.items():
            _call_soon(loop, _deliver_all, items)

    # event loop
    def _deliver(self, item: CompletionDelta | BaseException) -> None:
        self._queue.put_nowait(item)
        if self.listener is not None:
            self.listener()

    @property
    def has_output(self) -> bool:
        """An output or an error waits to be taken (serving's n > 1 waits for a first child's first output)."""
        return self._held_error is not None or not self._queue.empty()

    # event loop
    async def get(self) -> CompletionDelta:
        item = self._held_error or await self._queue.get()
        return self._take(item)

    def ready(self) -> list[CompletionDelta]:
        """The outputs delivered so far, without waiting (a relay sends them together). An error behind them is
        held back and raised by the next call."""
        if self._held_error is not None:
            self._take(self._held_error)
        items: list[CompletionDelta] = []
        while not self.finished and not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, BaseException) and items:
                self._held_error = item
                break
            items.append(self._take(item))
        return items

    def _take(self, item: CompletionDelta | BaseException) -> CompletionDelta:
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        if item.finished:
            self.finished = True
        return item

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> CompletionDelta:
        if self.finished:
            raise StopAsyncIteration
        return await self.get()


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[..., None], *args: Any) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the event loop is closed: nobody is listening any more
        pass


def _deliver_all(items: list[tuple[RequestStream, CompletionDelta]]) -> None:
    for stream, out in items:
        stream._deliver(out)


@dataclass
class _Add:
    request: EngineRequest
    stream: RequestStream
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Call:
    """Work on the engine between two steps (an adapter registered or removed)."""

    work: Callable[[LLMEngine], Any]
    done: concurrent.futures.Future = field(default_factory=concurrent.futures.Future)


class AsyncLLMEngine:
    """Runs ``engine.step()`` in a background thread whenever there is work; asyncio callers submit and stream."""

    def __init__(self, engine: LLMEngine, step_listeners: list[StepListener] | None = None) -> None:
        self.engine = engine
        self.step_listeners: list[StepListener] = list(step_listeners or [])
        self._cond = threading.Condition()
        self._commands: deque[_Add | _Abort | _Call] = deque()
        self._streams: dict[str, RequestStream] = {}  # loop thread only
        self._thread: threading.Thread | None = None
        self._stop = False
        self._drain = True
        self._idle = threading.Event()
        self._idle.set()
        self._last_progress = time.monotonic()  # the latest step that computed something, or the latest idle moment
        self._num_aborted_by_shutdown = 0
        self.error: BaseException | None = None

    # ------------------------------------------------------------------ pass-through, read-only
    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self.engine.tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.engine.config

    @property
    def limits(self) -> EngineLimits:
        return self.engine.limits

    def stats(self) -> SchedulerStats | None:
        """The scheduler's stats after the latest step (None before the first)."""
        return self.engine.last_stats

    @property
    def is_running(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    def stalled_for(self) -> float:
        """Seconds the loop has made no progress while requests were pending (0 while it progresses or idles)."""
        if self._idle.is_set():
            return 0.0
        return time.monotonic() - self._last_progress

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> AsyncLLMEngine:
        with self._cond:
            if self._thread is None:
                self._stop = False
                # steps run in the loop thread from now on: this thread (which built the model, as a rule) lets its
                # idle OpenMP workers go, or the loop's own would sleep after every operator (release_openmp_workers)
                release_openmp_workers()
                self._thread = threading.Thread(target=self._run, name="batchserve-engine-loop", daemon=True)
                self._thread.start()
        return self

    def shutdown(self, drain: bool = True, timeout: float | None = None) -> int:
        """Stop the loop. ``drain``: finish the requests in flight first, for at most ``timeout`` seconds, then
        abort what is left; otherwise abort them at once. Returns how many requests the shutdown aborted."""
        self._request_stop(drain)
        thread = self._thread
        if thread is None or thread is threading.current_thread():
            return self._num_aborted_by_shutdown
        thread.join(timeout)
        if thread.is_alive() and drain:
            self._request_stop(drain=False)
            thread.join()
        return self._num_aborted_by_shutdown

    def _request_stop(self, drain: bool) -> None:
        with self._cond:
            self._stop = True
            self._drain = drain
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Block until no request is in flight (for tests and draining)."""
        return self._idle.wait(timeout)

    # ------------------------------------------------------------------ any thread
    def abort(self, request_ids: str | list[str]) -> None:
        """Drop requests (unknown or finished ids are ignored); their KV blocks return to the pool next step."""
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        if ids:
            self._submit(_Abort(ids))

    def _submit(self, command: _Add | _Abort | _Call) -> None:
        with self._cond:
            if isinstance(command, _Abort) and (self.error is not None or self._thread is None):
                return  # nothing runs, nothing to abort
            if self.error is not None or (self._stop and not isinstance(command, _Abort)):
                raise EngineDeadError(f"engine is not running: {self.error or 'shut down'}")
            self._commands.append(command)
            self._idle.clear()
            self._cond.notify()

    # ------------------------------------------------------------------ event loop
    async def add_request(self, request: EngineRequest) -> RequestStream:
        """Hand a request to the loop; raises what ``engine.add_request`` raises (InvalidRequestError,
        QueueFullError) or EngineDeadError. Returns the stream of its outputs."""
        if self._thread is None:
            self.start()
        self._refuse_if_queue_full()
        stream = RequestStream(request, asyncio.get_running_loop())
        command = _Add(request, stream)
        self._submit(command)
        try:
            await asyncio.wrap_future(command.done)
        except asyncio.CancelledError:
            command.done.add_done_callback(lambda done: self._abort_if_added(done, request.request_id))
            raise
        return stream

    async def call(self, work: Callable[[LLMEngine], Any]) -> Any:
        """`work(engine)` on the loop thread between two steps; its result, or what it raised."""
        if self._thread is None:
            self.start()
        command = _Call(work)
        self._submit(command)
        return await asyncio.wrap_future(command.done)

    async def add_lora(self, lora: LoRARequest) -> LoRARequest:
        """Serve an adapter from now on: read and checked on a worker thread, registered between two steps (the
        running steps do not wait for the disk)."""
        adapter = await asyncio.to_thread(self.engine.read_lora, lora)
        return await self.call(lambda engine: engine.add_lora(lora, adapter))

    async def remove_lora(self, name: str) -> None:
        await self.call(lambda engine: engine.remove_lora(name))

    def lora_names(self) -> tuple[str, ...]:
        """The adapters served now (any thread: a snapshot)."""
        return self.engine.lora_names()

    def list_loras(self) -> list[LoRARequest]:
        return self.engine.list_loras()

    def _abort_if_added(self, done: concurrent.futures.Future, request_id: str) -> None:
        """A caller gave up on its add: abort the request once the loop has added it, and only then (an add that
        never ran, or failed on a taken id, would otherwise abort the other request holding that id)."""
        if not done.cancelled() and done.exception() is None:
            self.abort(request_id)

    def check_capacity(self) -> None:
        """QueueFullError now if a request added now would be refused for a full waiting queue: the serving layer
        asks before it tokenizes a prompt, so that under overload a 503 costs no tokenizer time."""
        self._refuse_if_queue_full()

    def _refuse_if_queue_full(self) -> None:
        """The engine's own refusal, answered here without waiting for the step in progress to end (under overload
        a 503 must not queue behind the engine): the waiting queue as of the latest step plus the adds not yet
        applied. It may refuse one step early (the running step may admit some waiting requests), never late."""
        limit = self.engine.config.scheduler.max_waiting_requests
        if limit is None:
            return
        with self._cond:  # held by the loop only to swap the command queue, never during a step
            pending = sum(isinstance(c, _Add) for c in self._commands)
        if self.engine.scheduler.num_waiting + pending >= limit:
            raise QueueFullError(f"the waiting queue is full ({limit} requests); retry later")

    async def generate(
        self,
        prompt: Prompt,
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[CompletionDelta]:
        """For scripts and tests: builds the request (``engine.requests``; a text is tokenized on this thread), then
        yields its delta of each step in which it progressed; aborts it if the caller stops early."""
        request = self.engine.requests.from_prompt(request_id or uuid.uuid4().hex, prompt, params, priority)
        stream = await self.add_request(request)
        try:
            async for out in stream:
                yield out
        finally:
            if not stream.finished:
                self.abort(request.request_id)

    # ------------------------------------------------------------------ loop thread
    def _run(self) -> None:
        adopt_torch_threads()
        try:
            while True:
                with self._cond:
                    while not self._commands and not self._has_work() and not self._stop:
                        self._idle.set()
                        self._cond.wait()
                        self._last_progress = time.monotonic()
                    commands = list(self._commands)
                    self._commands.clear()
                    stop, drain = self._stop, self._drain
                stepped_abort = self._apply(commands)
                if stop and not drain and self._streams:
                    self._num_aborted_by_shutdown += len(self._streams)
                    self._apply([_Abort(list(self._streams))])
                    stepped_abort = True
                if self._has_work() or stepped_abort:
                    if not self._step():
                        self._pause()
                elif stop:
                    break
        except BaseException as exc:  # noqa: BLE001 - the loop must report every failure to its waiters
            logger.exception("engine loop died")
            self._die(exc)
            return
        finally:
            self.engine.close()  # in this thread: no step can be running
        self._die(EngineDeadError("engine shut down"), crashed=False)

    def _has_work(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def _apply(self, commands: list[_Add | _Abort | _Call]) -> bool:
        """Run queued commands on the engine; True if something was aborted (a step returns its blocks)."""
        aborted = False
        for command in commands:
            if isinstance(command, _Call):
                _run_call(command, self.engine)
            elif isinstance(command, _Add):
                if not command.done.set_running_or_notify_cancel():
                    continue  # the caller gave up before the loop got to it
                try:
                    self.engine.add_request(command.request)
                except Exception as exc:  # noqa: BLE001 - handed back to the caller
                    command.done.set_exception(exc)
                    continue
                self._streams[command.request.request_id] = command.stream
                command.done.set_result(None)
            else:
                live = [rid for rid in command.request_ids if rid in self._streams]
                if live:
                    self.engine.abort_request(live)
                    aborted = True
                    for rid in live:
                        # The engine may or may not emit a final "abort" output; the caller is gone either way.
                        self._streams.pop(rid).put(EngineDeadError(f"request {rid} aborted"))
        return aborted

    def _pause(self) -> None:
        """A step that computed nothing (work pending that cannot run yet): wait a moment, or for a command,
        instead of spinning a core."""
        with self._cond:
            if not self._commands and not self._stop:
                self._cond.wait(IDLE_STEP_PAUSE_S)

    def _step(self) -> bool:
        """One engine step, its outputs handed to their streams; False if it computed nothing."""
        outputs = self.engine.step()
        stats = self.engine.last_stats
        progressed = bool(outputs) or (stats is not None and stats.num_scheduled_seqs > 0)
        if progressed:
            self._last_progress = time.monotonic()
        deliveries = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            deliveries.append((stream, out))
            if out.finished:
                del self._streams[out.request_id]
        RequestStream.put_step(deliveries)
        for listener in self.step_listeners:
            try:
                listener(self.engine, outputs)
            except Exception:  # noqa: BLE001 - a broken metrics hook must not stop serving
                logger.exception("step listener failed")
        return progressed

    def _die(self, exc: BaseException, crashed: bool = True) -> None:
        with self._cond:
            if crashed:
                self.error = exc
            self._stop = True
            pending = list(self._commands)
            self._commands.clear()
        dead = exc if isinstance(exc, EngineDeadError) else EngineDeadError(f"engine loop died: {exc!r}")
        for command in pending:
            if isinstance(command, _Add | _Call) and not command.done.done():
                command.done.set_exception(dead)
        for stream in self._streams.values():
            stream.put(dead)
        self._streams.clear()
        self._idle.set()


def _run_call(command: _Call, engine: LLMEngine) -> None:
    if not command.done.set_running_or_notify_cancel():
        return
    try:
        command.done.set_result(command.work(engine))
    except Exception as exc:  # noqa: BLE001 - handed back to the caller
        command.done.set_exception(exc)
