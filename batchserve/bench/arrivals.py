"""When each request is sent: all at once, a Poisson or gamma process at a request rate, optionally capped in flight.

A fixed concurrency is all-at-once arrivals with `max_concurrency` requests in flight: the driver sends the next request
as soon as one finishes (a closed loop). The arrival offsets are seconds from the start of the run.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

PROCESSES = ("poisson", "gamma")


@dataclass
class ArrivalProcess:
    request_rate: float = math.inf  # requests/s; inf sends every request at t=0
    process: str = "poisson"  # shape of the inter-arrival times at a finite rate
    burstiness: float = 1.0  # gamma shape: 1 is Poisson, < 1 burstier, > 1 more regular
    max_concurrency: int | None = None  # at most this many requests in flight (None: no cap)

    def validate(self) -> None:
        if not self.request_rate > 0:
            raise ValueError("request rate must be > 0 (inf: all at once)")
        if self.process not in PROCESSES:
            raise ValueError(f"arrival process must be one of {PROCESSES}")
        if not self.burstiness > 0:
            raise ValueError("burstiness must be > 0")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError("max concurrency must be >= 1")

    def offsets(self, n: int, seed: int = 0) -> list[float]:
        """Arrival time of each of n requests, seconds after the start; the first one arrives at 0."""
        self.validate()
        if math.isinf(self.request_rate):
            return [0.0] * n
        rng = random.Random(seed)
        if self.process == "poisson":
            gaps = [rng.expovariate(self.request_rate) for _ in range(n - 1)]
        else:  # gamma with mean 1/rate: shape k = burstiness, scale = 1 / (rate * k)
            k = self.burstiness
            gaps = [rng.gammavariate(k, 1.0 / (self.request_rate * k)) for _ in range(n - 1)]
        times, t = [0.0], 0.0
        for gap in gaps:
            t += gap
            times.append(t)
        return times[:n]

    def describe(self) -> str:
        rate = "all at once" if math.isinf(self.request_rate) else f"{self.process} at {self.request_rate:g} req/s"
        if self.process == "gamma" and not math.isinf(self.request_rate):
            rate += f" (burstiness {self.burstiness:g})"
        if self.max_concurrency:
            rate += f", at most {self.max_concurrency} in flight"
        return rate
