"""The scheduler's side of the disk tier (core/kv_tier.py): which blocks to look up, read back and write.

The KV cache manager asks it three things. At a prefix lookup, past the blocks the pool holds: which of the next
blocks the tier holds (their reads start now, in a background thread, so they overlap the steps that run before the
request is admitted). At allocation: the checked payloads of those blocks, in order up to the first one that is
missing or bad (the rest are recomputed); they travel to the worker in the step's SchedulerOutput (`kv_loads`) and are
copied into their blocks before the forward pass. When a full block is registered in the pool: its digest, so that the
worker copies it at the end of the step and writes it off the step path (`kv_saves`).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from batchserve.core.kv_tier import Retention, TierStore, block_digest
from batchserve.request import Request

logger = logging.getLogger(__name__)

PREFETCH_BYTES = 128 << 20  # payloads read ahead of admission wait in memory: at most this much


@dataclass(frozen=True)
class TierSave:
    block_id: int
    digest: bytes
    retention: Retention


class KVOffload:
    def __init__(self, store: TierStore, block_bytes: int, retention_of=None, prefetch: bool = True) -> None:
        """retention_of(request, block_index) -> Retention: a block's retention (core/retention.py); None: the
        default for every block. prefetch False: reads happen at admission, on the scheduler's thread (the
        simulator, whose store is an index on a virtual clock)."""
        self.store = store
        self.prefetch_blocks = max(4, PREFETCH_BYTES // block_bytes) if prefetch else 0
        self.retention_of = retention_of or (lambda request, index: Retention())
        self.req_digests: dict[str, list[bytes]] = {}
        self.loads: list[tuple[int, bytes]] = []  # (block id, payload) for the next step
        self.saves: list[TierSave] = []
        self._prefetch: OrderedDict[bytes, Future] = OrderedDict()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-read")

    @property
    def stats(self):
        return self.store.stats

    # ---- lookups ---------------------------------------------------------------------------------------------
    def holds(self, digest: bytes) -> bool:
        """One block past the pool's hit: in the tier? A hit starts its read."""
        if digest not in self._prefetch and not self.store.contains(digest):
            return False
        self._start_read(digest)
        return True

    def _start_read(self, digest: bytes) -> None:
        if not self.prefetch_blocks:
            return
        if digest in self._prefetch:
            self._prefetch.move_to_end(digest)
            return
        while len(self._prefetch) >= self.prefetch_blocks:
            self._prefetch.popitem(last=False)[1].cancel()
        self._prefetch[digest] = self._reader.submit(self.store.get, digest)

    def read(self, digests: Sequence[bytes]) -> list[bytes]:
        """The payloads of these consecutive blocks, checked, up to the first that is missing or bad."""
        payloads = []
        for digest in digests:
            future = self._prefetch.pop(digest, None)
            payload = future.result() if future is not None and not future.cancelled() else self.store.get(digest)
            if payload is None:
                break
            payloads.append(payload)
        self.store.stats.hits += len(payloads)
        return payloads

    # ---- writes ----------------------------------------------------------------------------------------------
    def digests(self, request: Request, keys: Sequence) -> list[bytes]:
        """The request's block digests, extended to cover `keys` (the manager's keys of its full blocks)."""
        chain = self.req_digests.setdefault(request.request_id, [])
        for key in keys[len(chain) :]:
            chain.append(block_digest(chain[-1] if chain else None, key))
        return chain

    def registered(self, request: Request, index: int, block_id: int, digest: bytes, loaded: bool) -> None:
        """A full block became findable in the pool: written to the tier unless it is there (or came from there)."""
        if loaded or not self.store.claim(digest):
            return
        self.saves.append(TierSave(block_id, digest, self.retention_of(request, index)))

    def forget(self, request_id: str) -> None:
        self.req_digests.pop(request_id, None)

    def take_step_io(self) -> tuple[list[tuple[int, bytes]], list[TierSave]]:
        loads, saves, self.loads, self.saves = self.loads, self.saves, [], []
        return loads, saves

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
