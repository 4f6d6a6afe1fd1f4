"""The disk tier's cheaper paths on a real (tiny, random) Llama: a prefix read back while another request's steps go
on (its blocks loading, the steps not waiting) gives transformers' tokens for both; the files written after saves of
every size hold each block's K/V exactly; only steps that complete a block hand saves to the writer, once for all of
them; a block held for the writer is not reused before it is written, and is free again once written or failed."""

from __future__ import annotations

import threading

import torch

from batchserve.request import RequestStatus
from batchserve.sampling_params import SamplingParams
from batchserve.worker.kv_cache import _parts
from tests.engine.test_kv_offload import BLOCK, _digest_chain, engine, evict_all, generate, prompt, tiny  # noqa: F401
from tests.tiny_models import hf_greedy


def test_a_read_back_overlaps_another_requests_steps(tiny, tmp_path):  # noqa: F811
    model, directory = tiny
    eng = engine(directory, tmp_path)
    tokens, other = prompt(1), prompt(2, 10)
    generate(eng, tokens)
    evict_all(eng)
    store, gate = eng.kv_tier.store, threading.Event()
    real_get = store.get

    def slow_get(digest):  # the disk is slow: every read waits for the gate
        assert gate.wait(30)
        return real_get(digest)

    store.get = slow_get
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    eng.add_prompt("r", other, params)
    outs: dict[str, list[int]] = {"r": [], "c": []}
    for delta in eng.step():
        outs[delta.request_id] += delta.delta_token_ids
    eng.add_prompt("c", tokens, SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    steps_while_loading = 0
    while eng.has_unfinished_requests():
        loading = "c" in eng.scheduler.requests and eng.scheduler.requests["c"].status == RequestStatus.LOADING
        deltas = eng.step()
        if loading and any(d.request_id == "r" and d.delta_token_ids for d in deltas):
            steps_while_loading += 1
            if steps_while_loading == 3:
                gate.set()
        for delta in deltas:
            outs[delta.request_id] += delta.delta_token_ids
    assert steps_while_loading >= 3  # r decoded while c's blocks were on their way back
    assert outs["c"] == hf_greedy(model, tokens, 6) and outs["r"] == hf_greedy(model, other, 12)
    assert eng.kv_tier.stats.hits == 5
    eng.close()


def test_written_files_hold_each_block_exactly(tiny, tmp_path):  # noqa: F811
    _, directory = tiny
    eng = engine(directory, tmp_path, dtype="bfloat16", num_kv_blocks=24)
    for seed, blocks in ((3, 2), (4, 7), (5, 1), (6, 9)):  # saves of growing and shrinking sizes reuse the rows
        tokens = prompt(seed, blocks * BLOCK + 1)
        generate(eng, tokens, max_tokens=1)
        kv = eng.scheduler.kv
        for i, digest in enumerate(_digest_chain(eng, tokens)):
            block = kv.pool.lookup(_key(tokens, i))
            pool_bytes = b"".join(t[block.block_id].contiguous().view(torch.uint8).numpy().tobytes()
                                  for layer in eng.runner.kv_caches for t in _parts(layer))  # fmt: skip
            assert bytes(eng.kv_tier.store.get(digest)) == pool_bytes
    eng.close()


def _key(tokens: list[int], index: int):
    from batchserve.core.block_pool import BlockKey

    parent = None
    for i in range(index + 1):
        key = BlockKey(parent, tuple(tokens[i * BLOCK : (i + 1) * BLOCK]))
        parent = key.hash
    return key


def test_only_steps_that_complete_a_block_hand_saves_over(tiny, tmp_path, monkeypatch):  # noqa: F811
    from batchserve.worker import kv_offload

    _, directory = tiny
    eng = engine(directory, tmp_path)
    handed: list[int] = []
    real = kv_offload.BlockWriter.save

    def counting(self, saves):
        handed.append(len(saves))
        return real(self, saves)

    monkeypatch.setattr(kv_offload.BlockWriter, "save", counting)
    generate(eng, prompt(8, 2 * BLOCK + 3), max_tokens=20)  # 23 steps; blocks complete in two of them
    assert handed == [2, 1] and eng.kv_tier.stats.blocks_written == 3
    assert eng.kv_tier.writer_holds.num_held == 0
    eng.close()


def run(eng, tokens: list[int], max_tokens: int = 1) -> None:
    eng.add_prompt(None, tokens, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    while eng.has_unfinished_requests():
        eng.step()


def pool_bytes(eng, block_id: int) -> bytes:
    return b"".join(t[block_id].contiguous().view(torch.uint8).numpy().tobytes()
                    for layer in eng.runner.kv_caches for t in _parts(layer))  # fmt: skip


def test_a_block_held_for_the_writer_is_not_reused_before_it_is_written(tiny, tmp_path):  # noqa: F811
    """The writer reads blocks from the pool. While it is stuck on a block, a request that needs nearly the whole
    pool takes every other block (the held ones not yet begun are given up, counted) but not that one: the file
    then holds the block's K/V as its request left it, and the block is free again once written."""
    _, directory = tiny
    eng = engine(directory, tmp_path, num_kv_blocks=12)
    store, holds = eng.kv_tier.store, eng.kv_tier.writer_holds
    real_put, entered, gate, calls = store.put, threading.Event(), threading.Event(), []

    def stuck_on_the_second(digest, payload, retention):
        calls.append(digest)
        if len(calls) == 2:
            entered.set()
            gate.wait(60)
        return real_put(digest, payload, retention)

    store.put = stuck_on_the_second
    tokens = prompt(8, 5 * BLOCK + 3)
    run(eng, tokens)  # 5 full blocks held, in order; the writer writes the first, then sticks on the second
    assert entered.wait(60)
    digests = _digest_chain(eng, tokens)
    second = eng.scheduler.kv.pool.lookup(_key(tokens, 1))
    before = pool_bytes(eng, second.block_id)
    run(eng, prompt(9, 11 * BLOCK - 8))  # 11 of the 12 blocks: all but the one being written
    assert holds.is_held(second.block_id) and pool_bytes(eng, second.block_id) == before
    assert eng.runner.offload.num_skipped == 3  # the third to fifth blocks, reused before the writer reached them
    gate.set()
    eng.runner.offload.flush()
    assert not holds.is_held(second.block_id) and holds.num_held == 0
    assert bytes(store.get(digests[1])) == before and store.get(digests[0]) is not None
    assert all(store.get(d) is None for d in digests[2:])
    assert scraped_skipped(eng) == 3
    eng.close()


def test_a_held_block_is_released_when_its_write_fails(tiny, tmp_path):  # noqa: F811
    _, directory = tiny
    eng = engine(directory, tmp_path, num_kv_blocks=12)

    def failing(digest, payload, retention):
        raise RuntimeError("no writing today")

    eng.kv_tier.store.put = failing
    generate(eng, prompt(10, 3 * BLOCK + 1), max_tokens=1)
    assert eng.kv_tier.writer_holds.num_held == 0 and eng.kv_tier.stats.blocks_written == 0
    generate(eng, prompt(11, 12 * BLOCK - 8), max_tokens=1)  # the whole pool: every block reusable again
    eng.close()


def scraped_skipped(eng) -> float:
    from tests.engine.test_kv_offload import scraped

    return scraped(eng)["batchserve:kv_tier_saves_skipped_total"]
