"""Large bodies the parse refused, remembered by their digest: the same bytes sent again get the same 400 without
being parsed again.

What the parse refuses (malformed JSON, a field out of bounds, a constraint over its size) follows from the body's
bytes, the route's request model and --lenient alone, so the answer can be given again from memory. A client that
loops one huge refused body (a 100k-entry `logit_bias` is tens of milliseconds of the parser's CPU) then costs a
read and a hash per refusal, as a body refused from its Content-Length costs a read. Refusals that depend on the
server's state (an unknown model: adapters come and go) are made after the parse and never remembered here. The
memory is bounded (`max_entries` refusals, the least recently met dropped first); a client that changes a byte of
its body each time is parsed each time, and waits for its refusals as every repeat offender does (error_delay.py).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field

from batchserve.entrypoints.openai.errors import APIError

DEFAULT_REFUSED_BODIES = 256

BodyKey = tuple[str, bool, bytes]  # the request model's name, lenient, the body's digest
_Refusal = tuple[int, str, str, str | None, str | None]  # APIError's status, message, type, param, code


async def body_key(body: bytes, model: type, lenient: bool) -> BodyKey:
    """The body's key, its digest taken on a worker thread (hashlib lets go of the interpreter lock for large
    inputs: a 4 MiB body's milliseconds are not the event loop's)."""
    digest = await asyncio.to_thread(lambda: hashlib.sha256(body).digest())
    return f"{model.__module__}.{model.__qualname__}", lenient, digest


@dataclass
class RefusedBodies:
    """Used from the event loop's thread only."""

    max_entries: int = DEFAULT_REFUSED_BODIES
    hits: int = 0  # refusals answered from memory
    _refusals: OrderedDict[BodyKey, _Refusal] = field(default_factory=OrderedDict)

    def refusal(self, key: BodyKey) -> APIError | None:
        """The refusal this body got before (a new exception each time), or None."""
        known = self._refusals.get(key)
        if known is None:
            return None
        self._refusals.move_to_end(key)
        self.hits += 1
        return APIError(*known)

    def remember(self, key: BodyKey, error: APIError) -> None:
        if not 400 <= error.status < 500 or error.headers:  # a refusal of the body itself, nothing to come back for
            return
        self._refusals[key] = (error.status, error.message, error.type, error.param, error.code)
        self._refusals.move_to_end(key)
        while len(self._refusals) > self.max_entries:
            self._refusals.popitem(last=False)

    def __len__(self) -> int:
        return len(self._refusals)
