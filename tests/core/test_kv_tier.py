"""The disk tier's store and retention without torch: files checked and atomic, LRU within the byte cap, eviction by
retention priority then by what waiting requests need then LRU (in the tier and in the pool), the index rebuilt by a
second store on the same directory, the options refused naming them."""

from __future__ import annotations

import os
import time

import pytest

from batchserve.core.block_pool import BlockKey, BlockPool
from batchserve.core.kv_tier import HEADER_BYTES, Retention, TierConfigError, TierStore, block_digest
from batchserve.kv_retention import KVRetention, TokenRangeRetention
from batchserve.sampling_params import InvalidRequestError, SamplingParams
from tests.core.helpers import make_request, make_scheduler

PAYLOAD = 1000


def store(tmp_path, blocks: int = 3, description: str = "model=a") -> TierStore:
    return TierStore(tmp_path, description, blocks * (HEADER_BYTES + PAYLOAD), PAYLOAD)


def digest(n: int) -> bytes:
    return block_digest(None, BlockKey(None, (n,)))


def test_round_trip_and_lru_within_the_cap(tmp_path):
    s = store(tmp_path)
    for n in range(3):
        assert s.put(digest(n), bytes([n]) * PAYLOAD)
        time.sleep(0.01)
    assert s.get(digest(0)) == bytes([0]) * PAYLOAD  # used: now the most recent
    s.put(digest(3), b"x" * PAYLOAD)
    assert not s.contains(digest(1)) and not s.path_of(digest(1)).exists()  # the least recently used went
    assert all(s.contains(digest(n)) for n in (0, 2, 3))
    assert s.stats.evicted == 1 and s.stats.bytes_used == 3 * (HEADER_BYTES + PAYLOAD)


def test_priority_then_waiting_needs_then_lru(tmp_path):
    s = store(tmp_path, blocks=4)
    s.put(digest(0), b"a" * PAYLOAD, Retention(90))  # oldest, but a system prompt kept at 90
    s.put(digest(1), b"b" * PAYLOAD)
    s.put(digest(2), b"c" * PAYLOAD)
    s.put(digest(3), b"d" * PAYLOAD, Retention(90, expires_at=time.time() - 1))  # its hour is over: default again
    s.protected = frozenset({digest(1)})  # a waiting request will hit it
    assert s.eviction_order() == [digest(2), digest(3), digest(1), digest(0)]  # plain LRU would start with 0


def test_a_second_store_rebuilds_the_index(tmp_path):
    first = store(tmp_path)
    first.put(digest(0), b"a" * PAYLOAD, Retention(80))
    first.put(digest(1), b"b" * PAYLOAD)
    os.utime(first.path_of(digest(1)), (1, 1))  # long unused
    (first.dir / ".crashed.tmp").write_bytes(b"half")
    os.utime(first.dir / ".crashed.tmp", (1, 1))
    second = store(tmp_path)
    assert len(second) == 2 and second.get(digest(0)) == b"a" * PAYLOAD
    assert second.eviction_order() == [digest(1), digest(0)]
    assert not (first.dir / ".crashed.tmp").exists()  # a crashed writer's leftovers go


def test_damaged_files_are_dropped_and_counted(tmp_path):
    s = store(tmp_path)
    s.put(digest(0), b"a" * PAYLOAD)
    s.put(digest(1), b"b" * PAYLOAD)
    s.put(digest(2), b"c" * PAYLOAD)
    path = s.path_of(digest(0))
    data = bytearray(path.read_bytes())
    data[-1] ^= 1
    path.write_bytes(bytes(data))
    s.path_of(digest(1)).write_bytes(s.path_of(digest(1)).read_bytes()[:-10])
    os.replace(s.path_of(digest(2)), s.path_of(digest(3)))  # a file under another block's name
    assert s.get(digest(0)) is None and s.get(digest(1)) is None and s.get(digest(3)) is None
    assert s.stats.corrupt_dropped == 3 and len(list(s.dir.glob("*.kvb"))) == 0


def test_another_fingerprint_never_reads_these_files(tmp_path):
    a, b = store(tmp_path, description="model=a"), store(tmp_path, description="model=b")
    a.put(digest(0), b"a" * PAYLOAD)
    assert a.dir != b.dir and not b.contains(digest(0))
    os.link(a.path_of(digest(0)), b.path_of(digest(0)))  # copied across by hand
    assert b.get(digest(0)) is None and b.stats.corrupt_dropped == 1


def test_options_refused_naming_them(tmp_path):
    with pytest.raises(TierConfigError, match="kv_offload_dir .* is not an existing directory"):
        TierStore(tmp_path / "nope", "m", 10**6, PAYLOAD)
    with pytest.raises(TierConfigError, match="kv_offload_max_bytes 100 is smaller than one KV block"):
        TierStore(tmp_path, "m", 100, PAYLOAD)


def test_digests_follow_the_whole_chain():
    a = block_digest(None, BlockKey(None, (1, 2)))
    assert a == block_digest(None, BlockKey(None, (1, 2)))
    assert a != block_digest(None, BlockKey(7, (1, 2)))  # another salt
    assert block_digest(a, BlockKey(123, (3, 4))) != block_digest(digest(9), BlockKey(123, (3, 4)))


# ---- retention in the pool ---------------------------------------------------------------------------------------
def test_pool_evicts_by_priority_before_lru():
    """A system prompt's blocks kept at 90 outlive newer default blocks: under plain LRU they would go first."""
    pool = BlockPool(4)
    old = pool.take_new(2)
    for n, block in enumerate(old):
        pool.register(block, BlockKey(None, (n,)))
        pool.retain(block, 90, 0.0)
    new = pool.take_new(2)
    for n, block in enumerate(new):
        pool.register(block, BlockKey(None, (10 + n,)))
    pool.release(old)  # released first: least recently used
    pool.release(new)
    taken = pool.take_new(2)
    assert taken == new and all(pool.lookup(BlockKey(None, (n,))) is not None for n in range(2))


def test_pool_priority_expires():
    pool = BlockPool(2)
    a, b = pool.take_new(2)
    pool.register(a, BlockKey(None, (1,)))
    pool.register(b, BlockKey(None, (2,)))
    pool.retain(a, 90, time.time() - 1)  # already over
    pool.release([a, b])
    assert pool.take_new(1) == [a]  # plain LRU again


def test_waiting_requests_keep_their_prefix_cached():
    """Two prompts cached, the older one's prefix wanted by a waiting request: a newcomer evicts the other one's
    blocks, though they were used more recently (plain LRU would evict the wanted prefix)."""
    sched = make_scheduler(num_blocks=6, block_size=4, max_batch_size=1, max_num_tokens=64)
    wanted = list(range(1, 9))
    run_alone(sched, make_request("a", prompt=wanted, max_tokens=1))
    run_alone(sched, make_request("b", prompt=list(range(20, 28)), max_tokens=1))
    sched.add_request(make_request("c", prompt=list(range(40, 52)), max_tokens=2))
    sched.add_request(make_request("d", prompt=wanted + [99], max_tokens=1))  # waits behind c (batch of one)
    sched.schedule()  # c takes the two never-used blocks and evicts one cached block
    pool, first = sched.kv.pool, BlockKey(None, tuple(wanted[:4]))
    assert pool.num_evictions == 1
    assert pool.lookup(first) is not None and pool.lookup(BlockKey(first.hash, tuple(wanted[4:]))) is not None
    assert pool.lookup(BlockKey(BlockKey(None, (20, 21, 22, 23)).hash, (24, 25, 26, 27))) is None


def test_the_protected_set_follows_the_head_of_the_queue_not_every_step():
    """The waiting head's block hashes are hashed once while the head stays put (the same set object step after
    step) and dropped when it leaves: an emptied queue protects nothing."""
    sched = make_scheduler(num_blocks=16, block_size=4, max_batch_size=1, max_num_tokens=64)
    sched.add_request(make_request("long", prompt=list(range(1, 13)), max_tokens=6))
    sched.add_request(make_request("next", prompt=list(range(30, 38)), max_tokens=1))
    sched.schedule()
    sched.schedule()  # "long" runs: "next" heads the queue
    pool = sched.kv.pool
    held = pool.free_queue.protected
    assert BlockKey(None, (30, 31, 32, 33)).hash in held
    sched.schedule()
    assert pool.free_queue.protected is held  # the same head: not rebuilt
    assert sched.num_waiting == 1  # "next" still waits behind the batch of one
    sched.abort_requests(["next"])
    sched.schedule()
    assert pool.free_queue.protected == frozenset()


def run_alone(sched, request):
    from batchserve.core.outputs import ModelOutput

    sched.add_request(request)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        ids = [r for r, n in out.num_scheduled_tokens.items() if sched.requests[r].num_computed_tokens + n >=
               sched.requests[r].num_tokens]  # fmt: skip
        sched.update_from_output(out, ModelOutput(req_ids=ids, sampled_token_ids=[7] * len(ids)))


def test_retention_field_is_checked_naming_it():
    config = KVRetention([TokenRangeRetention(0, 32, 90, 3600.0)])
    assert config.block_retention(16, 100) == (90, 3600.0) and config.block_retention(32, 100) == (35, None)
    params = SamplingParams(kv_retention={"token_ranges": [{"token_start": 0, "token_end": 8, "priority": 80}]})
    assert params.kv_retention.token_ranges[0].priority == 80
    for bad, name in [(101, "priority"), (0, "priority")]:
        with pytest.raises(InvalidRequestError, match=r"kv_retention.token_ranges\[0\].priority") as err:
            SamplingParams(kv_retention={"token_ranges": [{"token_start": 0, "priority": bad}]})
        assert err.value.args and name in str(err.value)
    with pytest.raises(InvalidRequestError, match="kv_retention.decode_priority"):
        SamplingParams(kv_retention={"decode_priority": 500})


# ---- the scheduler over the tier (payloads stand for K/V: the worker's side is tests/engine/test_kv_offload.py) ----
def _run_saving(sched, request, store: TierStore) -> None:
    """Serve one request alone, writing each block the steps hand over as the worker would (its digest as payload)."""
    from batchserve.core.outputs import ModelOutput

    sched.add_request(request)
    while sched.has_unfinished_requests():
        out = sched.schedule()
        for save in out.kv_saves:
            store.put(save.digest, save.digest * 4, save.retention)
        done = [r for r, n in out.num_scheduled_tokens.items()
                if sched.requests[r].num_computed_tokens + n >= sched.requests[r].num_tokens]  # fmt: skip
        sched.update_from_output(out, ModelOutput(req_ids=done, sampled_token_ids=[7] * len(done)))


def test_tier_blocks_count_as_computed_and_a_bad_one_is_recomputed(tmp_path):
    from batchserve.core.kv_offload import KVOffload

    sched = make_scheduler(num_blocks=5, block_size=4, max_num_tokens=64)
    tier = TierStore(tmp_path, "m", 10**6, 64)
    sched.kv.tier = KVOffload(tier, 64)
    prompt = list(range(1, 14))  # 3 full blocks and one token
    _run_saving(sched, make_request("a", prompt=prompt, max_tokens=1), tier)
    assert len(tier) == 3
    _run_saving(sched, make_request("b", prompt=list(range(50, 67)), max_tokens=1), tier)  # evicts a's blocks
    assert sched.kv.pool.lookup(BlockKey(None, (1, 2, 3, 4))) is None

    sched.add_request(make_request("c", prompt=prompt, max_tokens=1))
    out = sched.schedule()
    (new,) = out.new_requests
    assert new.num_computed_tokens == 12 and out.num_scheduled_tokens["c"] == 1  # only the last token is computed
    assert [block_id for block_id, _ in out.kv_loads] == new.block_ids[:3]
    chain = sched.kv.tier.req_digests["c"]
    assert [payload for _, payload in out.kv_loads] == [d * 4 for d in chain[:3]]
    assert not out.kv_saves  # read back, not written again

    sched.abort_requests(["c"])
    _run_saving(sched, make_request("d", prompt=list(range(70, 87)), max_tokens=1), tier)
    path = tier.path_of(chain[1])
    path.write_bytes(path.read_bytes()[:-1])  # truncated
    _run_saving(sched, make_request("e", prompt=prompt, max_tokens=1), tier)
    # e took the first block from the tier and recomputed from the bad one on (which was written anew)
    assert tier.stats.corrupt_dropped == 1 and tier.stats.hits == 4 and len(tier) == 3 + 4 + 4
    assert tier.get(chain[1]) == chain[1] * 4
