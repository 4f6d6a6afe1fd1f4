"""The engine core process: an LLMEngine (scheduler, runner, step loop) alone in its own interpreter, driven over a
channel by the API server process (engine/core_client.py). Nothing else runs here, so the server's event loop
never waits for a step, and a step never waits for the event loop: they share no GIL.

The loop, one thread: take every message waiting (adds, aborts, a shutdown), answer the adds at once (Admissions),
step the engine if it has work, send the step's outputs and stats (StepDone); with nothing to do, block on the
channel. The API process's death (the channel reports it within a second, host/channel.py) aborts everything and
ends the process. SIGINT and SIGTERM are ignored here: the API process drains and then tells the core to stop (a
Ctrl-C reaches the whole process group, and the core must not die before the drain)."""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable
from typing import Any

from batchserve.engine.async_engine import IDLE_STEP_PAUSE_S, EngineDeadError
from batchserve.engine.core_messages import (
    AbortRequests,
    AddRequests,
    Admissions,
    CoreFailed,
    CoreReady,
    EngineDescription,
    Shutdown,
    StepDone,
    Stopped,
    portable_error,
)
from batchserve.engine.llm_engine import LLMEngine
from batchserve.host.channel import Channel, PeerDeadError

logger = logging.getLogger(__name__)

EngineFactory = Callable[..., LLMEngine]  # module level (the spawned interpreter imports it by name)


def run_engine_core(
    channel: Channel,
    factory: EngineFactory,
    factory_args: tuple[Any, ...],
    factory_kwargs: dict[str, Any],
    num_threads: int | None,
    seed: int,
    log_level: int,
) -> None:
    """The engine core process's main (host/channel.start_child's target)."""
    from batchserve.host.process import configure_torch

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(levelname)s %(name)s[core]: %(message)s")
    configure_torch(num_threads, seed)
    try:
        engine = factory(*factory_args, **factory_kwargs)
    except Exception as exc:  # noqa: BLE001 - the API process reports it and exits
        logger.exception("the engine could not be built")
        channel.send(CoreFailed(portable_error(exc)))
        return
    try:
        channel.send(CoreReady(describe(engine)))
        CoreLoop(engine, channel).run()
    finally:
        engine.close()


def describe(engine: LLMEngine) -> EngineDescription:
    return EngineDescription(
        config=engine.config,
        limits=engine.limits,
        tokenizer=engine.tokenizer,
        effective_config=engine.effective_config(),
        num_kv_blocks=engine.runner.num_kv_blocks,
        fallback_names=list(engine.modes.fallback_names),
        pid=os.getpid(),
    )


class CoreLoop:
    def __init__(self, engine: LLMEngine, channel: Channel) -> None:
        self.engine = engine
        self.channel = channel
        self.live: set[str] = set()  # ids admitted and not yet finished
        self.stopping = False
        self.draining = True
        self.num_aborted = 0
        self.aborted: list[str] = []  # by a shutdown, since the last step: the API process ends their streams

    def run(self) -> None:
        try:
            while True:
                stepped_abort = self._take_messages(block=not self._has_work() and not self.stopping)
                if self.stopping and not self.draining and self.live:
                    self._abort(list(self.live), by_shutdown=True)
                    stepped_abort = True
                if self._has_work() or stepped_abort:
                    if not self._step():
                        self._take_messages(block=False, wait_s=IDLE_STEP_PAUSE_S)  # a step that computed nothing
                elif self.stopping:
                    break
        except PeerDeadError:
            logger.warning(
                "the API server process is gone: the engine core stops (%d requests dropped)", len(self.live)
            )
            return
        self.channel.send(Stopped(self.num_aborted))

    def _has_work(self) -> bool:
        return bool(self.engine.has_unfinished_requests())

    def _take_messages(self, block: bool, wait_s: float = 0.0) -> bool:
        """Apply every message waiting (with nothing to do, wait for one); True if something was aborted."""
        aborted = False
        ready = self.channel.poll(None if block else wait_s)
        while ready:
            aborted |= self._apply(self.channel.recv())
            ready = self.channel.poll(0.0)
        return aborted

    def _apply(self, message: Any) -> bool:
        if isinstance(message, AddRequests):
            self.channel.send(Admissions([(seq, self._add(request)) for seq, request in message.requests]))
            return False
        if isinstance(message, AbortRequests):
            return self._abort([rid for rid in message.request_ids if rid in self.live])
        if isinstance(message, Shutdown):
            self.stopping = True
            self.draining = self.draining and message.drain
            return False
        raise TypeError(f"the engine core got an unknown message: {type(message).__name__}")

    def _add(self, request: Any) -> BaseException | None:
        if self.stopping:
            return EngineDeadError("engine is not running: shutting down")
        try:
            self.engine.add_request(request)
        except Exception as exc:  # noqa: BLE001 - handed back to the caller
            return portable_error(exc)
        self.live.add(request.request_id)
        return None

    def _abort(self, request_ids: list[str], by_shutdown: bool = False) -> bool:
        if not request_ids:
            return False
        self.engine.abort_request(request_ids)
        self.live.difference_update(request_ids)
        if by_shutdown:
            self.num_aborted += len(request_ids)
            self.aborted += request_ids
        return True

    def _step(self) -> bool:
        engine = self.engine
        outputs = engine.step()
        stats = engine.last_stats
        progressed = bool(outputs) or (stats is not None and stats.num_scheduled_seqs > 0)
        for out in outputs:
            if out.finished:
                self.live.discard(out.request_id)
        if not progressed:
            return False  # nothing to report (work pending that cannot run yet): no message
        preemptions = {}
        if stats is not None and stats.num_preempted_this_step:  # traces mark them (serving/tracing.py)
            preemptions = {rid: r.num_preemptions for rid, r in engine.scheduler.requests.items()}
        self.channel.send(
            StepDone(outputs, stats, engine.last_step_time_s, engine.last_timings, engine.num_steps, progressed,
                     preemptions, self.aborted)
        )  # fmt: skip
        self.aborted = []
        return True
