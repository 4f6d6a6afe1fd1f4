"""Blocks held in the pool for the disk tier's writer (core/tier_holds.py): the pool does not reuse the block the
writer is reading before the writer is done with it, and reuses it after; a held block the writer has not begun is
given up (counted, its claim released) when the pool needs it, and so is a save past the writer's budget."""

from __future__ import annotations

import threading
import time

from batchserve.core.block_pool import BlockKey, BlockPool
from batchserve.core.kv_offload import TierSave
from batchserve.core.kv_tier import Retention
from batchserve.core.tier_holds import WriterHolds


def pool_with_holds(num_blocks: int, max_held: int = 8) -> tuple[BlockPool, WriterHolds, list[bytes]]:
    released: list[bytes] = []
    pool = BlockPool(num_blocks)
    holds = pool.writer_holds = WriterHolds(max_held, released.append)
    return pool, holds, released


def cached_free_block(pool: BlockPool, holds: WriterHolds, tokens: tuple[int, ...]) -> TierSave:
    """A block filled, registered, held for the writer and handed over (its step ran), then freed by its request."""
    [block] = pool.take_new(1)
    pool.register(block, BlockKey(None, tokens))
    save = TierSave(block.block_id, bytes(tokens) * 4, Retention())
    assert holds.hold(save)
    holds.ready([save])
    pool.release([block])
    return save


def test_the_block_being_written_is_not_reused_until_done_then_is():
    pool, holds, released = pool_with_holds(3)
    save = cached_free_block(pool, holds, (1, 2))
    assert holds.take() is save  # the writer reads it now
    taken = pool.take_new(2)  # it is first in line, yet the pool takes the two others
    assert save.block_id not in [b.block_id for b in taken]
    assert pool.lookup(BlockKey(None, (1, 2))) is not None and holds.is_held(save.block_id)
    holds.done(save)
    assert not holds.is_held(save.block_id)
    [again] = pool.take_new(1)
    assert again.block_id == save.block_id and pool.lookup(BlockKey(None, (1, 2))) is None
    assert holds.num_dropped == 0 and released == []


def test_with_no_other_free_block_the_pool_waits_for_the_writer():
    pool, holds, _ = pool_with_holds(1)
    save = cached_free_block(pool, holds, (3, 4))
    assert holds.take() is save
    finished = threading.Event()

    def writer():
        time.sleep(0.2)
        finished.set()
        holds.done(save)

    thread = threading.Thread(target=writer)
    thread.start()
    [block] = pool.take_new(1)
    assert finished.is_set() and block.block_id == save.block_id  # not handed out before the writer was done
    thread.join()
    assert holds.num_dropped == 0 and not holds.is_held(save.block_id)


def test_a_held_block_not_yet_written_is_given_up_when_the_pool_needs_it():
    pool, holds, released = pool_with_holds(2)
    first = cached_free_block(pool, holds, (5, 6))
    second = cached_free_block(pool, holds, (7, 8))
    [block] = pool.take_new(1)  # the least recently freed: its save is dropped, the block reused
    assert block.block_id == first.block_id
    assert holds.num_reused_first == holds.num_dropped == 1 and released == [first.digest]
    assert not holds.is_held(first.block_id)
    assert holds.take() is second  # the writer skips the dropped save
    holds.done(second)
    holds.close()
    assert holds.take() is None


def test_a_save_past_the_writers_budget_is_dropped_and_its_claim_released():
    pool, holds, released = pool_with_holds(4, max_held=1)
    kept = cached_free_block(pool, holds, (1,))
    over = TierSave(3, b"over", Retention())
    assert not holds.hold(over)
    assert holds.num_over_budget == holds.num_dropped == 1 and released == [b"over"] and holds.is_held(kept.block_id)
    holds.take()
    holds.done(kept)
    assert holds.hold(over)  # the writer owes nothing now: room again


def test_a_save_dropped_before_its_step_ran_never_reaches_the_writer():
    pool, holds, _ = pool_with_holds(2)
    [block] = pool.take_new(1)
    pool.register(block, BlockKey(None, (9,)))
    save = TierSave(block.block_id, b"x", Retention())
    holds.hold(save)
    pool.release([block])
    pool.take_new(2)  # reused before the step's end handed it over
    holds.ready([save])
    holds.close()
    assert holds.take() is None and holds.num_dropped == 1


def test_flush_waits_for_every_handed_over_save():
    pool, holds, _ = pool_with_holds(4)
    saves = [cached_free_block(pool, holds, (n,)) for n in range(3)]
    written: list[TierSave] = []

    def writer():
        while (save := holds.take()) is not None:
            time.sleep(0.05)
            written.append(save)
            holds.done(save)

    thread = threading.Thread(target=writer)
    thread.start()
    holds.flush()
    assert written == saves and holds.num_held == 0
    holds.close()
    thread.join()
