"""Stored responses (`store: true`): the response a client may GET back, and the conversation it ended, which a
later request continues with `previous_response_id`. In memory, bounded by a number of entries (the oldest goes
first) and an age: a server's memory never grows with its traffic, and a restart forgets them all."""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

DEFAULT_MAX_RESPONSES = 1024
DEFAULT_TTL_S = 3600.0


@dataclass(frozen=True)
class StoredResponse:
    response: dict[str, Any]  # the Response object as the client got it
    conversation: list[dict[str, Any]]  # chat messages: its input (without instructions) and its output turn
    stored_at: float


class ResponseStore:
    def __init__(
        self, max_responses: int = DEFAULT_MAX_RESPONSES, ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:  # fmt: skip
        if max_responses < 1 or ttl_s <= 0:
            raise ValueError("a response store holds at least one response, for a positive time")
        self.max_responses, self.ttl_s, self._clock = max_responses, ttl_s, clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()  # oldest first

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        self._expire()
        self._entries[response_id] = StoredResponse(response, conversation, self._clock())
        self._entries.move_to_end(response_id)
        while len(self._entries) > self.max_responses:
            self._entries.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        """The response, or None when it was never stored, was deleted, expired or was pushed out."""
        self._expire()
        return self._entries.get(response_id)

    def delete(self, response_id: str) -> bool:
        self._expire()
        return self._entries.pop(response_id, None) is not None

    def _expire(self) -> None:
        oldest_kept = self._clock() - self.ttl_s
        while self._entries:
            first = next(iter(self._entries.values()))
            if first.stored_at > oldest_kept:
                return
            self._entries.popitem(last=False)
