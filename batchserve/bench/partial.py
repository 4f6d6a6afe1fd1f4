"""What an interrupted benchmark still has: every finished request is appended to `requests.jsonl` as it finishes
(a killed process leaves that behind), and Ctrl-C or SIGTERM ends the run with the summary of what finished."""

from __future__ import annotations

import dataclasses
import functools
import json
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import TextIO

from batchserve.bench.metrics import RequestResult
from batchserve.bench.trace import RunTrace


class ResultLog:
    """The runs of one benchmark as they go: each finished request in memory and, given a path, as one JSON line on
    disk at once; each finished run's trace; notes (the warm-ups) for the report."""

    def __init__(self, path: Path | None) -> None:
        self.path = path
        self._file: TextIO | None = None
        self.started: dict[str, float] = {}  # label -> when its run started, on the run's own clock
        self.clocks: dict[str, Callable[[], float]] = {}
        self.results: dict[str, list[RequestResult]] = {}
        self.finished: dict[str, RunTrace] = {}
        self.notes: list[str] = []

    def recorder(self, label: str, clock: Callable[[], float] = time.monotonic) -> Callable[[RequestResult], None]:
        """The callback a run calls with each finished request; the run starts now. `clock` is the one the run stamps
        its requests with (lockstep runs each have a busy clock of their own), so a cut-short trace is timed on it."""
        self.started[label] = clock()
        self.clocks[label] = clock
        self.results.setdefault(label, [])
        return functools.partial(self.add, label)

    def add(self, label: str, result: RequestResult) -> None:
        self.results.setdefault(label, []).append(result)
        if self.path is None:
            return
        if self._file is None:  # opened on the first result: a run that fails to start leaves no file
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._file = self.path.open("a")
        self._file.write(json.dumps({"run": label, **dataclasses.asdict(result)}) + "\n")
        self._file.flush()

    def finish(self, label: str, trace: RunTrace) -> None:
        self.finished[label] = trace

    def note(self, text: str) -> None:
        print(text, flush=True)
        self.notes.append(text)

    def partial_traces(self) -> dict[str, RunTrace]:
        """The runs that finished, then the one cut short: its finished requests, timed to now."""
        traces = dict(self.finished)
        for label, results in self.results.items():
            if label not in traces and results:
                t0 = self.started[label]
                meta = {"duration_s": self.clocks[label]() - t0, "interrupted": True, "request_rate": None}
                traces[label] = RunTrace(label, t0, 1, [], list(results), meta)
        return traces

    def close(self) -> None:
        if self._file is not None:
            self._file.close()


@contextmanager
def sigterm_interrupts() -> Iterator[None]:
    """SIGTERM raises KeyboardInterrupt, as Ctrl-C does, so both end a run the same way."""

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
