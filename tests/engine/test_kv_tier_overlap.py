"""The disk tier's cheaper paths on a real (tiny, random) Llama: a prefix read back while another request's steps go
on (its blocks loading, the steps not waiting) gives transformers' tokens for both; the files written after saves of
every size hold each block's K/V exactly; only steps that complete a block copy anything, once for all of them."""

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


def test_only_steps_that_complete_a_block_copy(tiny, tmp_path, monkeypatch):  # noqa: F811
    from batchserve.worker import kv_offload

    _, directory = tiny
    eng = engine(directory, tmp_path)
    gathered: list[int] = []
    real = kv_offload.gather_parts

    def counting(kv_cache, block_ids):
        gathered.append(len(block_ids))
        return real(kv_cache, block_ids)

    monkeypatch.setattr(kv_offload, "gather_parts", counting)
    generate(eng, prompt(8, 2 * BLOCK + 3), max_tokens=20)  # 23 steps; blocks complete in two of them
    assert gathered == [2, 1] and eng.kv_tier.stats.blocks_written == 3
    eng.close()
