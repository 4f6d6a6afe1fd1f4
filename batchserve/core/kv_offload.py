"""The scheduler's side of the disk tier (core/kv_tier.py): which blocks to look up, read back and write.

The KV cache manager asks it three things. At a prefix lookup, past the blocks the pool holds: which of the next
blocks the tier holds (their reads start now, in a background thread, so they overlap the steps that run before the
request is admitted). At admission: the blocks are read back. With the worker's `copy_in` connected (the engine), the
request takes its blocks and a load job on the reader thread checks each payload and copies it into its block while
other requests' steps go on (`start_load`); the request waits, its blocks counted as being computed, until the job says
how many blocks arrived, in order up to the first missing or bad one (the rest are recomputed). Without it (the
simulator, model-free tests) the checked payloads travel in the step's SchedulerOutput (`kv_loads`) and are copied
before the forward pass. When a full block is registered in the pool: its digest, so that the worker writes it off the
step path once the step has filled it (`kv_saves`), reading it from the pool, where the block is held until then
(core/tier_holds.py).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from batchserve.core.kv_tier import Retention, TierStore, block_digest
from batchserve.core.tier_holds import WriterHolds
from batchserve.request import Request

logger = logging.getLogger(__name__)

PREFETCH_BYTES = 128 << 20  # payloads read ahead of admission wait in memory: at most this much


@dataclass(frozen=True)
class TierSave:
    block_id: int
    digest: bytes
    retention: Retention


class KVOffload:
    def __init__(
        self, store: TierStore, block_bytes: int, retention_of=None, prefetch: bool = True, readers: int = 1
    ) -> None:
        """retention_of(request, block_index) -> Retention: a block's retention (core/retention.py); None: the
        default for every block. prefetch False: reads happen at admission, on the scheduler's thread (the
        simulator, whose store is an index on a virtual clock). readers: threads that read a load job's blocks (the
        engine gives one per core it computes on, up to two)."""
        self.store = store
        self.block_bytes = block_bytes
        self.prefetch_blocks = max(4, PREFETCH_BYTES // block_bytes) if prefetch else 0
        self.retention_of = retention_of or (lambda request, index: Retention())
        self.req_digests: dict[str, list[bytes]] = {}
        self.loads: list[tuple[int, bytes]] = []  # (block id, payload) for the next step
        self.saves: list[TierSave] = []
        self._prefetch: OrderedDict[bytes, Future] = OrderedDict()
        self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-read")
        # more threads taking blocks of the same load job: a block goes to the pool rows by one readv, which, like the
        # CRC, runs without the GIL, so two readers move a prefix about twice as fast while the steps wait for it
        self._helpers = (
            ThreadPoolExecutor(max_workers=readers - 1, thread_name_prefix="kv-tier-read-more") if readers > 1 else None
        )
        self.readers = max(1, readers)
        # copy_in(pairs of block id and payload), on a reader thread; set by the worker (worker/kv_offload.py). A
        # payload may be the reading thread's buffer: valid during the call only
        self.copy_in: Callable[[list[tuple[int, object]]], None] | None = None
        # views_of(block id) -> the pool block's rows of each layer part, writable, in payload order, on a reading
        # thread: where read_into puts a checked block; set by the worker with copy_in. None: a block is read into the
        # reading thread's buffer and copied in by copy_in (a pool in one allocation takes it in one copy)
        self.views_of: Callable[[int], list] | None = None
        self._jobs: dict[Future, _LoadJob] = {}
        # the blocks held in the pool for the worker's writer, which reads them there (core/tier_holds.py); set by the
        # worker. None: saves are handed over in the step's output and written from there (the simulator)
        self.writer_holds: WriterHolds | None = None

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

    def start_load(self, digests: Sequence[bytes], block_ids: Sequence[int]) -> Future:
        """Read these consecutive blocks back into their (fresh) pool blocks on the reader thread; the future's result
        is how many arrived, in order up to the first missing or bad one. A block whose read started at lookup is
        copied from that read; the others (their reads cancelled here, if not yet begun) are read and checked by
        TierStore.read_into and copied into their pool blocks' rows (`views_of`)."""
        futures = [None if f is None or f.cancel() else f for f in (self._prefetch.pop(d, None) for d in digests)]
        job = _LoadJob(self, list(zip(digests, futures, block_ids)))
        future = self._reader.submit(job.run)
        for _ in range(self.readers - 1):
            self._helpers.submit(job.work)  # blocks it takes are awaited by run(): none is taken after run() returns
        self._jobs[future] = job
        future.add_done_callback(lambda f: self._jobs.pop(f, None))
        return future

    def _load_one(self, digest: bytes, future: Future | None, block_id: int) -> bool:
        """One block into its pool block: from its read at lookup, straight into its rows (read_into, views_of), or
        read into this thread's buffer and copied in; False: missing, bad or failed."""
        if future is None and self.views_of is not None:
            return self.store.read_into(digest, self.views_of(block_id))
        if future is not None and not future.cancelled():
            payload = future.result()
        else:
            payload = self.store.read_block(digest, self.block_bytes)
        if payload is None:
            return False
        self.copy_in([(block_id, payload)])
        return True

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
        save = TierSave(block_id, digest, self.retention_of(request, index))
        if self.writer_holds is None or self.writer_holds.hold(save):
            self.saves.append(save)

    def forget(self, request_id: str) -> None:
        self.req_digests.pop(request_id, None)

    def take_step_io(self) -> tuple[list[tuple[int, bytes]], list[TierSave]]:
        loads, saves, self.loads, self.saves = self.loads, self.saves, [], []
        return loads, saves

    def close(self) -> None:
        self._reader.shutdown(wait=True, cancel_futures=True)
        if self._helpers is not None:
            self._helpers.shutdown(wait=True, cancel_futures=True)


class _LoadJob:
    """One request's blocks read back into the pool, taken one at a time by the reader threads; the result counts
    the blocks that arrived in order up to the first that did not."""

    def __init__(self, offload: KVOffload, items: list[tuple[bytes, Future | None, int]]) -> None:
        self.offload = offload
        self.items = items
        self.ok = [False] * len(items)
        self._next = 0
        self._stop = len(items)  # the first block that failed: the ones after it are not worth reading
        self._busy = 0  # blocks being read now
        self._cond = threading.Condition()

    def work(self) -> None:
        while (i := self._take()) is not None:
            try:
                ok = self.offload._load_one(*self.items[i])
            except Exception:  # a load that fails is a miss: its tokens are recomputed, the engine goes on
                logger.exception("KV tier: reading a block back into the pool failed: it is recomputed")
                ok = False
            with self._cond:
                self.ok[i] = ok
                if not ok:
                    self._stop = min(self._stop, i)
                self._busy -= 1
                self._cond.notify_all()

    def _take(self) -> int | None:
        with self._cond:
            if self._next >= self._stop:
                return None
            self._next += 1
            self._busy += 1
            return self._next - 1

    def run(self) -> int:
        """On the reader thread: the blocks, then how many arrived."""
        self.work()
        with self._cond:
            self._cond.wait_for(lambda: self._busy == 0)
        arrived = next((i for i, ok in enumerate(self.ok) if not ok), len(self.ok))
        self.offload.store.count_hits(arrived)
        return arrived
