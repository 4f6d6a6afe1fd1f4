"""Model-free stand-ins: a word-level tokenizer and an engine that simulates static or continuous batching."""

from __future__ import annotations

import math
import time
from types import SimpleNamespace

import pytest

from batchserve.config import EngineConfig
from batchserve.core.outputs import SchedulerStats


class FakeTokenizer:
    """One token per whitespace-separated word; ids assigned on first sight."""

    def __init__(self) -> None:
        self.words: list[str] = []
        self.ids: dict[str, int] = {}

    def encode(self, text: str) -> list[int]:
        out = []
        for word in text.split():
            if word not in self.ids:
                self.ids[word] = len(self.words)
                self.words.append(word)
            out.append(self.ids[word])
        return out

    def decode(self, ids: list[int]) -> str:
        return " ".join(self.words[i] for i in ids)


class FakeEngine:
    """Each step: admit waiting requests (static: only into an empty batch), prefill a new one whole and sample its
    first token, or decode one token; a request finishes at max_tokens. Step time is `step_s` of real sleep."""

    def __init__(self, config: EngineConfig | None = None, step_s: float = 0.0, num_blocks: int = 256) -> None:
        self.config = config or EngineConfig()
        self.tokenizer = FakeTokenizer()
        self.step_s = step_s
        self.num_blocks = num_blocks
        self.waiting: list[SimpleNamespace] = []
        self.running: list[SimpleNamespace] = []
        self.last_stats: SchedulerStats | None = None

    def add_request(self, request_id, prompt, sampling_params, priority=0, arrival_time=None):
        self.waiting.append(
            SimpleNamespace(
                id=request_id,
                prompt=list(prompt),
                max_tokens=sampling_params.max_tokens,
                out=[],
                prefilled=False,
                arrival=arrival_time if arrival_time is not None else time.monotonic(),
                first=None,
                first_sched=None,
            )
        )

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        cap = self.config.scheduler.max_batch_size
        if self.config.scheduler.scheduler_policy == "static" and self.running:
            return
        while self.waiting and len(self.running) < cap:
            self.running.append(self.waiting.pop(0))

    def step(self):
        self._admit()
        if self.step_s:
            time.sleep(self.step_s)
        now = time.monotonic()
        scheduled, outputs, done = {}, [], []
        for r in self.running:
            scheduled[r.id] = (1 if r.prefilled else len(r.prompt), not r.prefilled)
            if r.first_sched is None:
                r.first_sched = now
            r.prefilled = True
            r.out.append(len(r.out) % 7)
            r.first = r.first or now
            finished = len(r.out) >= r.max_tokens
            metrics = SimpleNamespace(
                arrival_time=r.arrival,
                first_scheduled_time=r.first_sched,
                first_token_time=r.first,
                finished_time=now if finished else None,
                num_cached_tokens=0,
                num_preemptions=0,
            )
            outputs.append(
                SimpleNamespace(
                    request_id=r.id,
                    token_ids=list(r.out),
                    delta_token_ids=[r.out[-1]],
                    finished=finished,
                    finish_reason="length" if finished else None,
                    metrics=metrics,
                )
            )
            if finished:
                done.append(r)
        used = sum(math.ceil((len(r.prompt) + len(r.out)) / 16) for r in self.running)
        self.last_stats = SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_scheduled_seqs=len(scheduled),
            max_batch_size=self.config.scheduler.max_batch_size,
            num_prefill_tokens=sum(n for n, p in scheduled.values() if p),
            num_decode_tokens=sum(n for n, p in scheduled.values() if not p),
            kv_blocks_total=self.num_blocks,
            kv_blocks_used=used,
            kv_blocks_free=self.num_blocks - used,
            kv_blocks_cached_free=min(3, self.num_blocks - used),
            scheduled=scheduled,
        )
        self.running = [r for r in self.running if r not in done]
        return outputs


@pytest.fixture
def tokenizer() -> FakeTokenizer:
    return FakeTokenizer()


@pytest.fixture
def fake_engine_cls() -> type[FakeEngine]:
    return FakeEngine
