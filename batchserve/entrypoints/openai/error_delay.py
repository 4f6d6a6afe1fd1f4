"""Repeat offenders wait for their refusals: a client (its peer address) whose recent requests were refused with a
4xx gets its next 4xx answers delayed, doubling with each refusal up to a cap.

Refusing a bad request is cheap, but a sender that loops without pause makes thousands of them a second, and on a
small host those cheap refusals take the cores a stream needs. A client that waits for its answer (every HTTP client
does, one request per connection at a time) sends far less once its answers are slow, and the wait itself costs the
server a timer. Only 4xx answers are ever delayed: a request that is served, a 5xx or a 503 (Retry-After says when to
come back) goes out at once, so a well-behaved client sharing an offender's address is never slowed. A client that
stops offending is forgiven: its count halves every `half_life_s`.

The table of clients is bounded (`max_clients`, least recently refused dropped first): an attacker rotating through
addresses can push others out, never grow the server's memory.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_ERROR_DELAY_MAX_S = 5.0
DEFAULT_ERROR_DELAY_AFTER = 10
DEFAULT_ERROR_DELAY_CLIENTS = 4096
FIRST_DELAY_S = 0.05  # the first delayed refusal's wait; each further one doubles it
HALF_LIFE_S = 30.0
CLIENT_CLOSED = 499  # nobody is left to answer


@dataclass(frozen=True)
class ErrorDelayConfig:
    """`max_delay_s` 0 turns the delays off; `after`: refusals (recent, decayed) a client gets without delay."""

    max_delay_s: float = DEFAULT_ERROR_DELAY_MAX_S
    after: int = DEFAULT_ERROR_DELAY_AFTER
    max_clients: int = DEFAULT_ERROR_DELAY_CLIENTS
    half_life_s: float = HALF_LIFE_S

    def __post_init__(self) -> None:
        for name, value in (("--error-delay-max", self.max_delay_s), ("--error-delay-after", self.after)):
            if not value >= 0:  # NaN too
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.max_clients < 1:
            raise ValueError(f"--error-delay-clients must be >= 1, got {self.max_clients}")
        if not self.half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {self.half_life_s}")

    @property
    def enabled(self) -> bool:
        return self.max_delay_s > 0


@dataclass
class _Record:
    score: float  # refusals, each decaying with the half-life
    at: float  # when the score was last brought up to date


@dataclass
class OffenderTable:
    """Per-client refusal counts and the delay each new refusal gets; used from the event loop's thread only."""

    config: ErrorDelayConfig = field(default_factory=ErrorDelayConfig)
    clock: Any = time.monotonic
    delayed_total: int = 0
    delay_seconds_total: float = 0.0
    _clients: OrderedDict[str, _Record] = field(default_factory=OrderedDict)

    def refused(self, client: str | None) -> float:
        """Count one refusal of `client`; the seconds its answer waits (0: not a repeat offender)."""
        if client is None or not self.config.enabled:
            return 0.0
        now = self.clock()
        record = self._clients.pop(client, None)
        if record is None:
            record = _Record(0.0, now)
            while len(self._clients) >= self.config.max_clients:
                self._clients.popitem(last=False)
        record.score = record.score * 0.5 ** ((now - record.at) / self.config.half_life_s) + 1.0
        record.at = now
        self._clients[client] = record  # most recently refused last
        delay = self._delay(record.score)
        if delay > 0:
            self.delayed_total += 1
            self.delay_seconds_total += delay
        return delay

    def _delay(self, score: float) -> float:
        over = score - self.config.after
        if over <= 0:
            return 0.0
        doublings = min(math.ceil(over) - 1, 32)  # past the cap already: no larger powers needed
        return min(self.config.max_delay_s, FIRST_DELAY_S * 2.0**doublings)

    def __len__(self) -> int:
        return len(self._clients)


def client_key(scope: Scope) -> str | None:
    """The peer's address without its port: a client's connections share it."""
    client = scope.get("client")
    return client[0] if client else None


class ErrorDelayMiddleware:
    """Holds back the start of a 4xx answer by the offender table's delay; every other answer passes untouched."""

    def __init__(self, app: ASGIApp, offenders: OffenderTable) -> None:
        self.app = app
        self.offenders = offenders

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def delayed_send(message: Message) -> None:
            if message["type"] == "http.response.start" and 400 <= message["status"] < 500:
                if message["status"] != CLIENT_CLOSED:
                    delay = self.offenders.refused(client_key(scope))
                    if delay > 0:
                        await asyncio.sleep(delay)
            await send(message)

        await self.app(scope, receive, delayed_send)


class ErrorDelayCollector:
    """The table's counts for /metrics."""

    def __init__(self, offenders: OffenderTable, model_name: str) -> None:
        self.offenders = offenders
        self.model_name = model_name

    def collect(self) -> Iterable[Any]:
        labels = ["model_name"]
        delayed = CounterMetricFamily(
            "batchserve:error_responses_delayed", "4xx answers held back because their client is a repeat offender.",
            labels=labels,
        )  # fmt: skip
        delayed.add_metric([self.model_name], self.offenders.delayed_total)
        seconds = CounterMetricFamily(
            "batchserve:error_delay_seconds", "Seconds 4xx answers were held back in all.", labels=labels
        )
        seconds.add_metric([self.model_name], self.offenders.delay_seconds_total)
        clients = GaugeMetricFamily(
            "batchserve:error_delay_clients", "Clients with recent refusals in the offender table.", labels=labels
        )
        clients.add_metric([self.model_name], len(self.offenders))
        return [delayed, seconds, clients]
