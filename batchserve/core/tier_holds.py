"""Full blocks held in the pool for the disk tier's writer, which reads them from the pool's own memory.

A full, hashed block is never written again, so the writer needs no copy of it: only that the pool does not hand the
block out for new tokens before the writer has read it. A block is held from the moment it is registered for writing
(the scheduler's thread, core/kv_offload.py) until the writer has written it, failed to or given it up. The pool asks
`release_for_reuse` before it reuses a free block (core/block_pool.py): a block still waiting for the writer is given
up there (a dropped save, counted: only a future hit is lost) and reused at once; the one block the writer is reading
right now is not, and the pool takes the next free block instead. So the pool never waits for the disk, and its free
count means what it means with the tier off.

Threads: the pool, the scheduler and the runner touch these holds on the engine's thread, the writer on its own; one
lock guards the holds and nothing else (the pool's own state stays the engine thread's). A writer behind by more than
`max_blocks` (the byte budget over a block's bytes) drops the saves after those, which caps how much it owes.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any


class WriterHolds:
    def __init__(self, max_blocks: int, release_claim: Callable[[bytes], None] = lambda digest: None) -> None:
        """max_blocks: the most blocks held for the writer at once; release_claim(digest): a dropped save's claim on
        the store given back (TierStore.release), so that the block is written when it is computed again."""
        self.max_blocks = max(1, max_blocks)
        self.release_claim = release_claim
        self.num_over_budget = 0  # saves not held: the writer owed its whole budget
        self.num_reused_first = 0  # held saves given up: the pool needed the block before the writer reached it
        self._held: dict[int, Any] = {}  # block id -> its save (core/kv_offload.TierSave), until written or dropped
        self._queue: deque = deque()  # saves whose step has run: the writer takes them oldest first
        self._writing: int | None = None  # the block the writer reads now
        self._closed = False
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    # ---- the engine's thread ---------------------------------------------------------------------------------
    def hold(self, save) -> bool:
        """Hold the save's block for the writer (at registration, before the step that fills it); False: the writer
        owes its whole budget already, so the save is dropped and counted."""
        with self._lock:
            if len(self._held) >= self.max_blocks:
                self.num_over_budget += 1
                dropped = True
            else:
                self._held[save.block_id] = save
                dropped = False
        if dropped:
            self.release_claim(save.digest)
        return not dropped

    def ready(self, saves: Sequence) -> None:
        """These saves' step has run (their blocks hold their K/V): the writer may take them."""
        with self._lock:
            self._queue.extend(s for s in saves if self._held.get(s.block_id) is s)
            self._changed.notify_all()

    def release_for_reuse(self, block_id: int) -> bool:
        """The pool is about to reuse this free block: True when it may (not held, or its save dropped now); False
        while the writer is reading it."""
        with self._lock:
            if self._writing == block_id:
                return False
            save = self._held.pop(block_id, None)
            if save is not None:
                self.num_reused_first += 1
        if save is not None:
            self.release_claim(save.digest)
        return True

    def wait_written(self, block_id: int) -> None:
        """Until the writer is done with this block (the pool has no other free block to take)."""
        with self._changed:
            self._changed.wait_for(lambda: self._writing != block_id)
        self.release_for_reuse(block_id)

    def flush(self) -> None:
        """Until every save made ready is written (tests, benchmarks, shutdown, a pool resize)."""
        with self._changed:
            self._changed.wait_for(lambda: self._closed or (not self._queue and self._writing is None))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            self._changed.notify_all()

    @property
    def num_dropped(self) -> int:
        """Saves given up, either way: each only a future hit lost."""
        return self.num_over_budget + self.num_reused_first

    def is_held(self, block_id: int) -> bool:
        with self._lock:
            return block_id in self._held

    @property
    def num_held(self) -> int:
        with self._lock:
            return len(self._held)

    # ---- the writer's thread ---------------------------------------------------------------------------------
    def take(self):
        """The oldest ready save still held, now being written (the pool will not reuse its block until `done`);
        None once closed."""
        with self._changed:
            while True:
                while self._queue:
                    save = self._queue.popleft()
                    if self._held.get(save.block_id) is save:  # else dropped since (its block may hold another now)
                        self._writing = save.block_id
                        return save
                self._changed.notify_all()  # an empty queue: flush() may be waiting
                if self._closed:
                    return None
                self._changed.wait()

    def done(self, save) -> None:
        """The writer is finished with this save, written or not: its block is free to be reused."""
        with self._changed:
            if self._held.get(save.block_id) is save:
                del self._held[save.block_id]
            self._writing = None
            self._changed.notify_all()
