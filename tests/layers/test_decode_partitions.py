"""Decode over contexts longer than one partition (work_split.h's kDecodePartitionTokens): every attention path and
pool type against float32 attention over the same values, and a sequence's bits alone, in a batch and on any number
of threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchserve.layers import kernels, kv_quant

PARTITION = 1024  # work_split.h kDecodePartitionTokens
# one partition, its edge, just past it, and several with a ragged last one
LENS = [1, 300, PARTITION - 1, PARTITION, PARTITION + 1, 2 * PARTITION + 517]
BF16_TOLERANCE = {"atol": 1e-2, "rtol": 1e-2}
F32_TOLERANCE = {"atol": 2e-5, "rtol": 2e-5}


def runnable(path: str) -> None:
    if not kernels.attention_path_runs(path):
        pytest.skip(f"attention path {path!r} cannot run here")


def pool_and_tables(lens, block_size, kv_heads, head_dim, dtype, seed=0):
    """A shuffled pool holding each sequence's blocks, and their tables."""
    gen = torch.Generator().manual_seed(seed)
    per_seq = [-(-n // block_size) for n in lens]
    blocks = sum(per_seq) + 2
    shape = (blocks, block_size, kv_heads, head_dim)
    key, value = (torch.randn(shape, generator=gen).to(dtype) for _ in range(2))
    order = torch.randperm(blocks, generator=gen)
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int64)
    used = 0
    for i, n in enumerate(per_seq):
        tables[i, :n] = order[used : used + n]
        used += n
    return key, value, tables


def expected(query, key, value, tables, lens, scale):
    """float32 SDPA of each sequence's one query row over its gathered context."""
    heads, kv_heads = query.shape[1], key.shape[2]
    rows = []
    for b, n in enumerate(lens):
        k, v = (t[tables[b]].flatten(0, 1)[:n].float() for t in (key, value))
        k, v = (t.repeat_interleave(heads // kv_heads, 1).transpose(0, 1) for t in (k, v))
        rows.append(F.scaled_dot_product_attention(query[b][:, None], k, v, scale=scale)[:, 0])
    return torch.stack(rows)


@pytest.mark.parametrize("path", kernels.ATTENTION_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 128), (4, 2, 48)], ids=str)
@pytest.mark.parametrize("block_size", [9, 16])
def test_partitioned_contexts_match_float32_attention(path, dtype, heads, block_size, native_kernels):
    # block size 9: partitions round up to whole blocks (1,026 tokens); head size 48 takes the portable loop
    runnable(path)
    num_heads, kv_heads, head_dim = heads
    key, value, tables = pool_and_tables(LENS, block_size, kv_heads, head_dim, dtype)
    query = torch.randn(len(LENS), num_heads, head_dim, generator=torch.Generator().manual_seed(1))
    scale = head_dim**-0.5
    out = native_kernels.paged_decode_attention(
        query, key, value, tables, torch.tensor(LENS), scale, getattr(native_kernels.AttentionPath, path)
    )
    tolerance = BF16_TOLERANCE if dtype == torch.bfloat16 else F32_TOLERANCE
    torch.testing.assert_close(out, expected(query, key, value, tables, LENS, scale), **tolerance)


@pytest.mark.parametrize("path", kernels.ATTENTION_PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_long_context_is_the_same_bits_alone_in_a_batch_and_on_any_thread_count(path, dtype, native_kernels):
    # Its partitions are cut by its own length only, and merged in their order: neither the other sequences of the
    # step (which change the items and who computes them) nor the threads change a bit of its row.
    runnable(path)
    lens = [3 * PARTITION + 200, 40, 5000, 7, 1500, 2 * PARTITION]
    key, value, tables = pool_and_tables(lens, 16, 3, 64, dtype)
    query = torch.randn(len(lens), 9, 64, generator=torch.Generator().manual_seed(1))
    which = getattr(native_kernels.AttentionPath, path)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = native_kernels.paged_decode_attention(query[:1], key, value, tables[:1], torch.tensor(lens[:1]),
                                                      0.125, which)  # fmt: skip
        batches = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            batches.append(native_kernels.paged_decode_attention(query, key, value, tables, torch.tensor(lens),
                                                                 0.125, which))  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(batch[:1], alone) for batch in batches)
    assert torch.equal(batches[0], batches[1]) and torch.equal(batches[0], batches[2])


@pytest.mark.parametrize("path", kernels.ATTENTION_PATHS)
@pytest.mark.parametrize("code", [torch.int8, torch.float8_e4m3fn], ids=str)
@pytest.mark.parametrize("head_dim", [64, 24])
def test_partitioned_contexts_on_a_quantized_pool(path, code, head_dim, native_kernels, monkeypatch):
    # head size 64: the path's vectorized kernel on the codes; 24: the plain loop
    runnable(path)
    monkeypatch.setenv("BATCHSERVE_ATTENTION_PATH", path)
    kernels.attention_path.cache_clear()
    try:
        gen = torch.Generator().manual_seed(3)
        lens = [PARTITION + 1, 2 * PARTITION + 300, 17]
        blocks = sum(-(-n // 16) for n in lens) + 2  # as pool_and_tables, whose tables index it
        pool = kv_quant.QuantizedKV.zeros((blocks, 16, 2, head_dim), torch.device("cpu"), dtype=code)
        slots = blocks * 16
        kv_quant.write(torch.randn(slots, 2, head_dim, generator=gen), torch.randn(slots, 2, head_dim, generator=gen),
                       pool, torch.arange(slots))  # fmt: skip
        _, _, tables = pool_and_tables(lens, 16, 2, head_dim, torch.float32)
        query = torch.randn(len(lens), 6, head_dim, generator=gen)
        out = kv_quant.native_decode(query, pool, tables, torch.tensor(lens), 0.125)
        assert out is not None
        keys, values = kv_quant.dequantized_pool(pool)
        torch.testing.assert_close(out, expected(query, keys, values, tables, lens, 0.125), atol=1e-5, rtol=1e-5)
    finally:
        kernels.attention_path.cache_clear()
