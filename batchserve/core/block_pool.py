"""Physical KV blocks: reference counts, an LRU free queue with O(1) removal, and the prefix-cache map.

A block is free when no request owns it (ref_count == 0). A free block may still hold the K/V of a full block
of tokens and stay findable by its hash: it is reused as-is on a prefix hit, and only overwritten when the pool
runs out of never-used blocks and evicts it from the head of the free queue (least recently freed first).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from batchserve.core.tier_holds import WriterHolds

DEFAULT_PRIORITY = 35  # a block's retention priority unless its request's kv_retention says otherwise (1-100)
PROTECT_SCAN = 64  # blocks looked past, at one level, for one that no waiting request needs


class BlockAccountingError(RuntimeError):
    """A block freed more often than it was taken: a bug in the caller, never silently ignored."""


@dataclass(frozen=True)
class BlockKey:
    """What a full block holds: its parent's key hash and its own tokens. Compared in full on a hit."""

    parent_hash: int | None
    token_ids: tuple[int, ...]

    @property
    def hash(self) -> int:
        return hash((self.parent_hash, self.token_ids))


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    key: BlockKey | None = None  # set once the block is full and registered in the prefix cache
    priority: int = DEFAULT_PRIORITY  # retention (batchserve/kv_retention.py): lower is evicted first
    expires_at: float = 0.0  # time.time() after which the priority counts as the default; 0: never
    free_order: int = 0  # when it joined the free queue (RetentionFreeQueue): an expired block keeps its LRU place
    prev_free: KVBlock | None = field(default=None, repr=False)
    next_free: KVBlock | None = field(default=None, repr=False)


class FreeBlockQueue:
    """Doubly linked list threaded through the blocks: popleft, append and remove-from-middle are O(1)."""

    def __init__(self, blocks: Iterable[KVBlock]) -> None:
        self._head = KVBlock(-1)  # sentinels: no special cases at the ends
        self._tail = KVBlock(-1)
        self._head.next_free, self._tail.prev_free = self._tail, self._head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def append(self, block: KVBlock) -> None:
        last = self._tail.prev_free
        assert last is not None
        last.next_free, block.prev_free = block, last
        block.next_free, self._tail.prev_free = self._tail, block
        self.num_free += 1

    def prepend(self, blocks: Sequence[KVBlock]) -> None:
        """Put blocks at the head, in this order: taken before every block already free."""
        for block in reversed(blocks):
            first = self._head.next_free
            assert first is not None
            self._head.next_free, block.prev_free = block, self._head
            block.next_free, first.prev_free = first, block
            self.num_free += 1

    def remove(self, block: KVBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise BlockAccountingError(f"block {block.block_id} is not in the free queue")
        prev.next_free, nxt.prev_free = nxt, prev
        block.prev_free = block.next_free = None
        self.num_free -= 1

    def popleft(self) -> KVBlock:
        first = self._head.next_free
        if first is self._tail or first is None:
            raise BlockAccountingError("no free blocks")
        self.remove(first)
        return first

    def __iter__(self):
        block = self._head.next_free
        while block is not self._tail and block is not None:
            yield block
            block = block.next_free


class RetentionFreeQueue:
    """Free blocks by retention: one LRU queue per priority level, the lowest level taken first; within a level a
    block no waiting request needs (`protected`: key hashes) goes before one that some request will hit. With every
    block at the default priority and nothing protected it is exactly one FreeBlockQueue."""

    def __init__(self, blocks: Iterable[KVBlock], clock=time.time) -> None:
        self.levels: dict[int, FreeBlockQueue] = {DEFAULT_PRIORITY: FreeBlockQueue(blocks)}
        self.protected: frozenset[int] = frozenset()
        self.clock = clock
        self._next_expiry = float("inf")  # the earliest expiry of a block above or below the default level
        self._last, self._first = 0, 0  # free_order of the newest and the oldest free blocks

    @property
    def num_free(self) -> int:
        return sum(q.num_free for q in self.levels.values())

    def _level(self, block: KVBlock) -> FreeBlockQueue:
        level = block.priority if block.key is not None else DEFAULT_PRIORITY
        if level != DEFAULT_PRIORITY and block.expires_at:
            self._next_expiry = min(self._next_expiry, block.expires_at)
        queue = self.levels.get(level)
        if queue is None:
            queue = self.levels[level] = FreeBlockQueue(())
        return queue

    def append(self, block: KVBlock) -> None:
        self._last += 1
        block.free_order = self._last
        self._level(block).append(block)

    def prepend(self, blocks: Sequence[KVBlock]) -> None:
        for block in reversed(blocks):
            self._first -= 1
            block.free_order = self._first
            self._level(block).prepend([block])

    def remove(self, block: KVBlock) -> None:
        queue = self.levels.get(block.priority if block.key is not None else DEFAULT_PRIORITY)
        if queue is None:
            raise BlockAccountingError(f"block {block.block_id} is not in the free queue")
        queue.remove(block)

    def popleft(self) -> KVBlock:
        if self.clock() >= self._next_expiry:
            self._demote_expired()
        for level in sorted(self.levels):
            queue = self.levels[level]
            if queue.num_free:
                block = self._first_unprotected(queue)
                queue.remove(block)
                return block
        raise BlockAccountingError("no free blocks")

    def _first_unprotected(self, queue: FreeBlockQueue) -> KVBlock:
        head = next(iter(queue))
        if not self.protected:
            return head
        for n, block in enumerate(queue):
            if n >= PROTECT_SCAN:
                break
            if block.key is None or block.key.hash not in self.protected:
                return block
        return head  # every block looked at will be needed: the least recently used of them goes

    def _demote_expired(self) -> None:
        """Blocks whose retention ran out join the default level where their last use puts them (rare: the level is
        rebuilt in free order)."""
        now, self._next_expiry = self.clock(), float("inf")
        expired = []
        for level, queue in list(self.levels.items()):
            if level == DEFAULT_PRIORITY:
                continue
            for block in list(queue):
                if block.expires_at and block.expires_at <= now:
                    queue.remove(block)
                    block.priority, block.expires_at = DEFAULT_PRIORITY, 0.0
                    expired.append(block)
                elif block.expires_at:
                    self._next_expiry = min(self._next_expiry, block.expires_at)
        if expired:
            default = self.levels[DEFAULT_PRIORITY]
            merged = sorted([*default, *expired], key=lambda b: b.free_order)
            for block in list(default):
                default.remove(block)
            for block in merged:
                default.append(block)

    def __iter__(self):
        for level in sorted(self.levels):
            yield from self.levels[level]


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = RetentionFreeQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}  # key hash -> block holding that content
        self.num_evictions = 0
        self._num_cached_free = 0  # kept incrementally: stats read it every step
        self.null_block: KVBlock | None = None  # reserve_null_block (sliding windows only)
        # the disk tier's writer reads held blocks from the pool (core/tier_holds.py): asked before a cached block is
        # reused; None: no tier
        self.writer_holds: WriterHolds | None = None

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_free_blocks(self) -> int:
        return self._num_cached_free

    def grow(self, num_blocks: int) -> None:
        """num_blocks in all: the new ones are never used, so they are taken before any cached free block is evicted.
        The worker's cache must have grown to match first."""
        if num_blocks < self.num_blocks:
            raise ValueError(f"a block pool only grows: {self.num_blocks} blocks, asked for {num_blocks}")
        new = [KVBlock(i) for i in range(self.num_blocks, num_blocks)]
        self.blocks += new
        self.free_queue.prepend(new)
        self.num_blocks = num_blocks

    def reserve_null_block(self) -> KVBlock:
        """One block taken for good: the placeholder a sliding-window request's table keeps where blocks that left
        the window were (attention masks those positions, so whatever it holds is never used)."""
        if self.null_block is None:
            [self.null_block] = self.take_new(1)
        return self.null_block

    def block_ids_with_content(self) -> list[int]:
        """The blocks whose K/V is still needed: owned by a request, or free but cached for a prefix (the null block's
        placeholder content never is)."""
        return [b.block_id for b in self.blocks if (b.ref_count > 0 or b.key is not None) and b is not self.null_block]

    def take_new(self, count: int) -> list[KVBlock]:
        """Blocks with fresh (writable) content, each owned once. The caller checks num_free_blocks first."""
        if count > self.num_free_blocks:
            raise BlockAccountingError(f"asked for {count} blocks, {self.num_free_blocks} free")
        blocks = [self._pop_reusable() for _ in range(count)]
        for block in blocks:
            self._evict(block)
            block.ref_count = 1
            block.priority, block.expires_at = DEFAULT_PRIORITY, 0.0
        return blocks

    def _pop_reusable(self) -> KVBlock:
        """The next free block to overwrite. A cached one held for the disk tier's writer gives its save up; the one
        the writer reads now stays, first in line, and the next is taken (the writer reads one block at a time)."""
        block = self.free_queue.popleft()
        holds = self.writer_holds
        if holds is None or block.key is None or holds.release_for_reuse(block.block_id):
            return block
        if self.free_queue.num_free == 0:
            holds.wait_written(block.block_id)
            return block
        other = self._pop_reusable()
        self.free_queue.prepend([block])
        return other

    def lookup(self, key: BlockKey) -> KVBlock | None:
        block = self.cached.get(key.hash)
        return block if block is not None and block.key == key else None

    def take_cached(self, blocks: Sequence[KVBlock]) -> None:
        """Share blocks found by lookup(); a free one leaves the free queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
                self._num_cached_free -= 1
            block.ref_count += 1

    def release(self, blocks: Sequence[KVBlock]) -> None:
        """Drop one reference from each; the ones that become free join the queue in this order (evicted first)."""
        for block in blocks:
            if block.ref_count <= 0:
                raise BlockAccountingError(f"double free of block {block.block_id}")
            block.ref_count -= 1
            if block.ref_count == 0:
                self.free_queue.append(block)
                self._num_cached_free += block.key is not None

    def retain(self, block: KVBlock, priority: int, expires_at: float) -> None:
        """A held block's retention, once it is free again: the highest asked for by the requests sharing it."""
        if priority > block.priority or (priority == block.priority and block.expires_at and not expires_at):
            block.priority, block.expires_at = priority, expires_at

    def register(self, block: KVBlock, key: BlockKey) -> None:
        """Make a full block findable by its content. A duplicate of cached content stays private."""
        if not self.enable_caching or block.key is not None:
            return
        if key.hash in self.cached:
            return
        block.key = key
        self.cached[key.hash] = block

    def _evict(self, block: KVBlock) -> None:
        if block.key is not None:
            del self.cached[block.key.hash]
            block.key = None
            self.num_evictions += 1
            self._num_cached_free -= block.ref_count == 0


class HostBlockPool:
    """Host-memory blocks for swapped-out requests: a plain free list, no sharing, no caching."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def take(self, count: int) -> list[int]:
        if count > len(self._free):
            raise BlockAccountingError(f"asked for {count} host blocks, {len(self._free)} free")
        return [self._free.pop() for _ in range(count)]

    def release(self, block_ids: Sequence[int]) -> None:
        for block_id in block_ids:
            if block_id in self._free:
                raise BlockAccountingError(f"double free of host block {block_id}")
            self._free.append(block_id)
