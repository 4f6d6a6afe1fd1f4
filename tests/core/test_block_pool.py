import pytest

from batchserve.core.block_pool import BlockAccountingError, BlockKey, BlockPool, FreeBlockQueue, HostBlockPool, KVBlock


def ids(queue: FreeBlockQueue) -> list[int]:
    return [b.block_id for b in queue]


def test_free_queue_remove_from_middle_keeps_order():
    blocks = [KVBlock(i) for i in range(5)]
    queue = FreeBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4] and queue.num_free == 4
    queue.append(blocks[2])
    assert ids(queue) == [0, 1, 3, 4, 2]
    assert queue.popleft().block_id == 0


def test_take_release_and_double_free():
    pool = BlockPool(4)
    a, b = pool.take_new(2)
    assert (a.block_id, b.block_id) == (0, 1) and pool.num_free_blocks == 2
    pool.release([b, a])
    assert pool.num_free_blocks == 4
    with pytest.raises(BlockAccountingError):
        pool.release([a])
    with pytest.raises(BlockAccountingError):
        pool.take_new(5)


def test_cached_block_survives_free_and_is_evicted_lru():
    pool = BlockPool(3)
    key = BlockKey(None, (1, 2, 3, 4))
    (block,) = pool.take_new(1)
    pool.register(block, key)
    pool.release([block])
    assert pool.lookup(key) is block and pool.num_cached_free_blocks == 1
    # the two never-used blocks go first; the cached one (freed last) is evicted only then
    taken = pool.take_new(2)
    assert block not in taken and pool.lookup(key) is block
    (again,) = pool.take_new(1)
    assert again is block and pool.lookup(key) is None and pool.num_evictions == 1


def test_lookup_compares_content_not_only_hash():
    pool = BlockPool(2)
    (block,) = pool.take_new(1)
    pool.register(block, BlockKey(None, (1, 2)))
    assert pool.lookup(BlockKey(None, (1, 2))) is block
    assert pool.lookup(BlockKey(7, (1, 2))) is None  # same tokens, other parent


def test_shared_block_ref_counts():
    pool = BlockPool(2)
    (block,) = pool.take_new(1)
    pool.register(block, BlockKey(None, (5,)))
    pool.take_cached([block])
    assert block.ref_count == 2
    pool.release([block])
    assert pool.num_free_blocks == 1 and block.ref_count == 1
    pool.release([block])
    assert pool.num_free_blocks == 2


def test_host_pool_double_free():
    host = HostBlockPool(2)
    got = host.take(2)
    host.release(got)
    with pytest.raises(BlockAccountingError):
        host.release(got[:1])


def test_grown_pool_takes_its_new_blocks_before_evicting_a_cached_one():
    pool = BlockPool(2)
    key = BlockKey(None, (1, 2))
    first, _ = pool.take_new(2)
    pool.register(first, key)
    pool.release([first])  # cached and free
    pool.grow(4)
    assert pool.num_blocks == 4 and pool.num_free_blocks == 3
    assert [b.block_id for b in pool.take_new(2)] == [2, 3]  # the never-used ones first
    assert pool.lookup(key) is first
    with pytest.raises(ValueError, match="only grows"):
        pool.grow(3)


def test_the_blocks_with_content_are_the_owned_and_the_cached_free_ones_not_the_null_block():
    pool = BlockPool(6)
    null = pool.reserve_null_block()
    owned, cached, plain = pool.take_new(1), pool.take_new(1), pool.take_new(1)
    pool.register(cached[0], BlockKey(None, (1, 2)))
    pool.release(cached + plain)
    assert pool.block_ids_with_content() == sorted([owned[0].block_id, cached[0].block_id])
    assert null.block_id not in pool.block_ids_with_content()
