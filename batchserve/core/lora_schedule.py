"""How many LoRA adapters share a step, and how a waiting adapter gets its turn.

The rule is kept on admission: a request joins the running set only if its adapter already runs, it runs the base
model, or fewer than max_loras adapters run; every step schedules only running requests, so no step ever carries
more than max_loras adapters.

No starvation: a request whose adapter cannot join (max_loras others run) is passed over while later requests of
running adapters and of the base model go ahead, but only while it is younger than `patience_s` seconds in the queue.
Past that it is "due": later requests of running adapters stop joining (base-model requests still do), so the
running adapters drain as their requests finish, and the first one to have none left frees its place for the due
adapter. Its wait is thus bounded by patience_s plus the time the shortest-lived running adapter needs to finish
the requests it already runs.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from batchserve.request import Request


class AdapterGate:
    def __init__(self, max_loras: int | None, patience_s: float = 1.0) -> None:
        """max_loras None: adapters off, every request admitted."""
        self.max_loras = max_loras
        self.patience_s = patience_s
        self.running: Counter[int] = Counter()  # adapter -> running requests with it
        self.due: int | None = None  # the adapter of a request that has waited past patience_s for a place

    @property
    def active(self) -> bool:
        return self.max_loras is not None

    def track(self, running: Iterable[Request]) -> None:
        """The running set, recounted before each admission."""
        if not self.active:
            return
        self.running = Counter(r.lora_id for r in running if r.lora_id)
        if self.due is not None and self.due in self.running:
            self.due = None  # it got its place

    def admits(self, request: Request, now: float) -> bool:
        """May `request` join the running set now? Marks its adapter due when it has waited too long for a place."""
        lora_id = request.lora_id
        if not lora_id or not self.active:
            return True
        if lora_id in self.running:
            return self.due is None or self.due == lora_id
        if len(self.running) < self.max_loras:
            return self.due is None or self.due == lora_id
        if self.due is None and now - request.arrival_time >= self.patience_s:
            self.due = lora_id
        return False

    def adapters(self) -> list[int]:
        return sorted(self.running)


LORA_SALT = 0x4C6F5241  # mixed into the first block's parent of an adapter's sequences


def first_parent(request: Request) -> int | None:
    """The parent of a sequence's first block in its prefix-cache keys: its cache salt, and its adapter when it has
    one, so that two adapters (or an adapter and the base model) never share K/V of the same tokens."""
    if not request.lora_id:
        return request.cache_salt
    return hash((LORA_SALT, request.lora_id, request.cache_salt or 0))
