"""Reading a block back into the pool: TierStore.read_into reads a file (one readv into the thread's reusable
buffer), checks it and copies it into the pool block's part rows, failing every damage get() fails; a load job
counts the blocks in order up to the first that did not arrive. Model-free: numpy rows stand in
for the pool's parts."""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import pytest

from batchserve.core.block_pool import BlockKey
from batchserve.core.kv_offload import KVOffload
from batchserve.core.kv_tier import HEADER_BYTES, TierStore, block_digest

PARTS, ROW = 4, 250  # a block: 4 layer parts of 250 bytes each
PAYLOAD = PARTS * ROW


def digest(n: int) -> bytes:
    return block_digest(None, BlockKey(None, (n,)))


def payload(n: int) -> bytes:
    return np.random.default_rng(n).integers(0, 256, PAYLOAD, dtype=np.uint8).tobytes()


@pytest.fixture
def tier(tmp_path):
    store = TierStore(tmp_path, "model=a", 64 * (HEADER_BYTES + PAYLOAD), PAYLOAD)
    for n in range(8):
        assert store.put(digest(n), [payload(n)[:300], payload(n)[300:]])  # written in two pieces, as the writer does
    pool = [np.zeros((10, ROW), np.uint8) for _ in range(PARTS)]
    return store, pool


def block_of(pool, block_id: int) -> bytes:
    return b"".join(rows[block_id].tobytes() for rows in pool)


def test_read_into_fills_the_pool_block(tier):
    store, pool = tier
    assert store.read_into(digest(3), [rows[7] for rows in pool])
    assert block_of(pool, 7) == payload(3) and block_of(pool, 6) == bytes(PAYLOAD)
    assert store.stats.blocks_read == 1 and store.stats.bytes_read == HEADER_BYTES + PAYLOAD


@pytest.mark.parametrize("damage", ["flipped_byte", "truncated", "overlong", "other_block", "other_layout", "gone"])
def test_read_into_refuses_every_damage(tier, damage):
    store, pool = tier
    path = store.path_of(digest(0))
    data = bytearray(path.read_bytes())
    if damage == "flipped_byte":
        data[HEADER_BYTES + 600] ^= 1
    elif damage == "truncated":
        data = data[:-1]
    elif damage == "overlong":
        data += b"\0"
    elif damage == "other_block":
        data = bytearray(store.path_of(digest(1)).read_bytes())
    path.write_bytes(bytes(data))
    if damage == "gone":
        path.unlink()
    views = [rows[0] for rows in pool]
    if damage == "other_layout":  # the file is whole, but a block of this pool is larger than its payload
        views = [np.zeros(ROW + 1, np.uint8) for _ in range(PARTS)]
    assert not store.read_into(digest(0), views)
    assert not path.exists() and not store.contains(digest(0))
    assert store.stats.corrupt_dropped == (0 if damage == "gone" else 1) and store.stats.hits == 0


def test_a_load_counts_the_blocks_up_to_the_first_missing_one(tier):
    store, pool = tier
    offload = KVOffload(store, PAYLOAD)
    offload.copy_in = lambda pairs: pytest.fail("no payload was read ahead: every block goes by read_into")
    offload.views_of = lambda block_id: [rows[block_id] for rows in pool]
    os.unlink(store.path_of(digest(5)))  # block 5 is missing: 5 and after are computed
    future = offload.start_load([digest(n) for n in range(8)], list(range(8)))
    assert future.result(timeout=10) == 5 and store.stats.hits == 5
    assert all(block_of(pool, n) == payload(n) for n in range(5))
    offload.close()


@pytest.mark.parametrize("missing", [None, 5])
def test_two_readers_share_a_load_and_count_in_order(tier, missing):
    """With readers=2 a second thread takes blocks of the same job: every block lands in its own pool block, and the
    count still stops at the first missing one (a block after it read by the other thread is not counted)."""
    store, pool = tier
    offload = KVOffload(store, PAYLOAD, readers=2)
    offload.views_of = lambda block_id: [rows[block_id] for rows in pool]
    read_into, threads = store.read_into, []

    def slow_read_into(digest, views):  # slow enough that the second reader takes some blocks while the first reads
        threads.append(threading.current_thread().name)
        time.sleep(0.05)
        return read_into(digest, views)

    store.read_into = slow_read_into
    if missing is not None:
        os.unlink(store.path_of(digest(missing)))
    future = offload.start_load([digest(n) for n in range(8)], [9 - n for n in range(8)])  # pool blocks 9..2
    arrived = 8 if missing is None else missing
    assert future.result(timeout=30) == arrived and store.stats.hits == arrived
    assert all(block_of(pool, 9 - n) == payload(n) for n in range(arrived))
    assert {name.rsplit("_", 1)[0] for name in threads} == {"kv-tier-read", "kv-tier-read-more"}
    offload.close()
