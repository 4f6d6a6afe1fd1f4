"""A situation on the fake runner: the real engine and scheduler over tests/fake_runner.py, LiveStats attached as a
server attaches it, and requests sent on a schedule from a thread while doctor watches."""

from __future__ import annotations

import asyncio
import itertools
import threading
from dataclasses import dataclass
from typing import Any

from batchserve.doctor.observe import Observation, watch
from batchserve.engine.async_engine import AsyncLLMEngine
from batchserve.sampling_params import SamplingParams
from batchserve.serving.live_stats import LiveStats
from tests.server.fakes import fake_engine


@dataclass
class Send:
    at_s: float  # after the load starts
    prompt_len: int
    max_tokens: int


def steady(rate: float, duration_s: float, prompt_len: int, max_tokens: int) -> list[Send]:
    return [Send(i / rate, prompt_len, max_tokens) for i in range(int(rate * duration_s))]


def observe_load(sends: list[Send], window_s: float, delay_s: float = 0.004, **options: Any) -> Observation:
    """Start the engine, send `sends` from a thread, watch for `window_s` seconds (from the first send), then stop
    the engine (aborting what is left) and wait for the sending thread."""
    engine = AsyncLLMEngine(fake_engine(delay_s=delay_s, **options))
    live = LiveStats().attach(engine)
    engine.start()
    thread = threading.Thread(target=asyncio.run, args=(_send_all(engine, sends),), daemon=True)
    try:
        thread.start()
        return watch(lambda since, after: live.snapshot(since, True, after), window_s)
    finally:  # what is still queued when the window closes is no part of it: aborted, not served for seconds more
        engine.shutdown(drain=False)
        thread.join(60)


async def _send_all(engine: AsyncLLMEngine, sends: list[Send]) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    tasks = []
    for i, send in enumerate(sends):
        await asyncio.sleep(max(0.0, start + send.at_s - loop.time()))
        tasks.append(asyncio.create_task(_one(engine, f"r{i}", send)))
    await asyncio.gather(*tasks, return_exceptions=True)


async def _one(engine: AsyncLLMEngine, request_id: str, send: Send) -> None:
    prompt = [
        65 + (i + len(request_id)) % 26 for i in range(send.prompt_len)
    ]  # letters: no shared prefixes to speak of
    params = SamplingParams(max_tokens=send.max_tokens, ignore_eos=True)
    async for _ in engine.generate(prompt, params, request_id=request_id):
        pass


def observe_closed_loop(clients: int, warmup_s: float, window_s: float, prompt_len: int, max_tokens: int,
                        delay_s: float = 0.004, **options: Any) -> Observation:  # fmt: skip
    """`clients` that each send a request as soon as their last one finished, already running for `warmup_s` when
    the watch starts: the server is found with its backlog, as a user finds it when they reach for doctor."""
    engine = AsyncLLMEngine(fake_engine(delay_s=delay_s, **options))
    live = LiveStats().attach(engine)
    engine.start()
    stop = threading.Event()
    thread = threading.Thread(target=asyncio.run, args=(_loop_all(engine, clients, prompt_len, max_tokens, stop),),
                              daemon=True)  # fmt: skip
    try:
        thread.start()
        stop.wait(warmup_s)
        return watch(lambda since, after: live.snapshot(since, True, after), window_s)
    finally:
        stop.set()
        engine.shutdown(drain=False)
        thread.join(60)


async def _loop_all(engine: AsyncLLMEngine, clients: int, prompt_len: int, max_tokens: int,
                    stop: threading.Event) -> None:  # fmt: skip
    async def client(k: int) -> None:
        for i in itertools.count():
            if stop.is_set():
                return
            await _one(engine, f"c{k}-{i}", Send(0.0, prompt_len, max_tokens))

    await asyncio.gather(*(client(k) for k in range(clients)), return_exceptions=True)
