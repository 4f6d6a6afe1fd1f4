"""A prefix read back from the disk tier without stopping the steps: the request takes its blocks and waits (LOADING)
while the reader thread copies the blocks in, the running requests' steps go on, and it is admitted once they have
arrived, their tokens computed; a bad block and the blocks after it are recomputed; a request ended while loading
gives its blocks back only once the copy into them is over. Model-free: copy_in records what the worker would copy."""

from __future__ import annotations

import threading

from batchserve.core.kv_offload import KVOffload
from batchserve.core.kv_tier import TierStore
from batchserve.core.outputs import ModelOutput
from batchserve.request import RequestStatus
from tests.core.helpers import make_request, make_scheduler

PROMPT = list(range(1, 14))  # 3 full blocks of 4 tokens and one token


def step(sched, store: TierStore | None = None):
    """One step: saves written as the worker would (the digest as payload), every scheduled request finishing its
    tokens samples 7."""
    out = sched.schedule()
    for save in out.kv_saves if store is not None else ():
        store.put(save.digest, save.digest * 4, save.retention)
    done = [r for r, n in out.num_scheduled_tokens.items()
            if sched.requests[r].num_computed_tokens + n >= sched.requests[r].num_tokens]  # fmt: skip
    sched.update_from_output(out, ModelOutput(req_ids=done, sampled_token_ids=[7] * len(done)))
    return out


def tier_with_prompt_on_disk(tmp_path):
    """A scheduler whose tier holds PROMPT's three blocks and whose pool no longer does; copy_in waits for `gate`."""
    sched = make_scheduler(num_blocks=10, block_size=4, max_num_tokens=64)
    store = TierStore(tmp_path, "m", 10**6, 64)
    sched.kv.tier = KVOffload(store, 64)
    for rid, prompt in (("a", PROMPT), ("b", list(range(50, 87)))):  # b fills the pool: a's blocks are evicted
        sched.add_request(make_request(rid, prompt=prompt, max_tokens=1))
        while sched.has_unfinished_requests():
            step(sched, store)
    assert len(store) == 3 + 9
    gate, copied = threading.Event(), []

    def copy_in(pairs):  # a payload is the reader's buffer, valid during this call only: kept as a copy
        assert gate.wait(10)
        copied.extend((block_id, bytes(payload)) for block_id, payload in pairs)

    sched.kv.tier.copy_in = copy_in
    return sched, store, gate, copied


def test_the_steps_go_on_while_a_prefix_is_read_back(tmp_path):
    sched, store, gate, copied = tier_with_prompt_on_disk(tmp_path)
    sched.add_request(make_request("r", prompt=[90, 91], max_tokens=6))
    step(sched)
    sched.add_request(make_request("c", prompt=PROMPT, max_tokens=1))
    for _ in range(2):  # the read is held: r's decodes go on, c holds its three blocks and is not scheduled
        out = step(sched)
        assert out.num_scheduled_tokens == {"r": 1}
        c = sched.requests["c"]
        assert c.status == RequestStatus.LOADING and sched.kv.is_loading(c)
        assert sched.kv.num_blocks_of(c) == 3 and c.num_computed_tokens == 0 and c not in sched.running
    gate.set()
    sched.kv.tier_loads["c"].future.result(timeout=10)
    chain = _chain(sched, c)
    out = step(sched)
    (new,) = out.new_requests
    assert new.req_id == "c" and new.num_computed_tokens == 12 and out.num_scheduled_tokens["c"] == 1
    assert copied == [(block_id, d * 4) for block_id, d in zip(new.block_ids[:3], chain)]
    assert not out.kv_loads and not out.kv_saves  # copied in by the reader; found in the tier, not written again
    assert store.stats.hits == 3 and c.num_cached_prompt_tokens == 12


def test_a_bad_block_and_the_ones_after_it_are_computed(tmp_path):
    sched, store, gate, copied = tier_with_prompt_on_disk(tmp_path)
    gate.set()
    sched.add_request(make_request("c", prompt=PROMPT, max_tokens=1))
    digests = _chain(sched, sched.requests["c"])
    path = store.path_of(digests[1])
    path.write_bytes(path.read_bytes()[:-1])  # truncated
    out = step(sched)  # nothing else runs: the scheduler waits for the read, then admits c
    (new,) = out.new_requests
    assert new.num_computed_tokens == 4 and out.num_scheduled_tokens["c"] == 9
    # the scheduler's thread reads beside the reader (nothing else runs): the block after the bad one may have been
    # copied too, into a block of c's that its step then computes over; the bad one never is
    assert new.block_ids[0] in [b for b, _ in copied] and new.block_ids[1] not in [b for b, _ in copied]
    assert {b for b, _ in copied} <= set(new.block_ids[:3])
    assert store.stats.corrupt_dropped == 1 and store.stats.hits == 1
    assert [s.digest for s in out.kv_saves] == digests[1:2]  # recomputed, so written anew (the third is on disk)


def test_a_request_ended_while_loading_frees_its_blocks_after_the_copy(tmp_path):
    sched, store, gate, copied = tier_with_prompt_on_disk(tmp_path)
    sched.add_request(make_request("r", prompt=[90, 91], max_tokens=6))
    step(sched)
    sched.add_request(make_request("c", prompt=PROMPT, max_tokens=1))
    step(sched)
    free, load = sched.kv.pool.num_free_blocks, sched.kv.tier_loads["c"]
    sched.abort_requests(["c"])
    assert sched.kv.pool.num_free_blocks == free  # the reader may still be writing into them
    gate.set()
    load.future.result(timeout=10)
    while sched.has_unfinished_requests():
        step(sched)
    sched.add_request(make_request("d", prompt=[95], max_tokens=1))
    step(sched)
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks and not sched.kv.tier_loads


def _chain(sched, request) -> list[bytes]:
    from batchserve.core.block_pool import BlockKey
    from batchserve.core.lora_schedule import first_parent

    keys, parent = [], first_parent(request)
    for i in range(len(request.prompt_token_ids) // 4):
        keys.append(BlockKey(parent, tuple(request.prompt_token_ids[i * 4 : (i + 1) * 4])))
        parent = keys[-1].hash
    return list(sched.kv.tier.digests(request, keys))
