"""A virtual clock: time moves only when the simulator says so (a step's modelled duration, an idle wait)."""

from __future__ import annotations


class VirtualClock:
    def __init__(self, start: float = 0.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += max(0.0, seconds)

    def sleep(self, seconds: float) -> None:  # OfflineRun's idle wait: jump to the next arrival at once
        self.advance(seconds)

    def advance_to(self, t: float) -> None:
        self.now = max(self.now, t)
