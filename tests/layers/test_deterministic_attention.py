"""Deterministic attention (worker/input_batch.py _rows_as_decodes): every row of a step attends as a decode of its own,
so on every native attention path (forced) a row's output bits are the same whether its sequence is decoded alone or
with others, prefilled whole, in chunks of 16, 64 or an odd size, or among other sequences' rows in any order."""

from __future__ import annotations

import pytest
import torch

from batchserve.layers import kernels

BLOCK, HEADS, KV_HEADS, D = 16, 6, 2, 64
LENGTHS = (150, 37, 90)  # three sequences' contexts in the pool


def _pool(dtype: torch.dtype):
    torch.manual_seed(0)
    blocks = sum(-(-n // BLOCK) for n in LENGTHS) + 1
    keys = torch.randn(blocks, BLOCK, KV_HEADS, D).to(dtype)
    values = torch.randn(blocks, BLOCK, KV_HEADS, D).to(dtype)
    order = torch.randperm(blocks - 1) + 1  # scattered blocks, as a pool hands them out
    tables, used = [], 0
    for n in LENGTHS:
        count = -(-n // BLOCK)
        tables.append(order[used : used + count])
        used += count
    return keys, values, tables


def _attend(native, path, pool, queries, rows: list[tuple[int, int]]) -> torch.Tensor:
    """Rows given as (sequence, position), each a decode of its own: keys up to its position."""
    keys, values, tables = pool
    width = max(len(t) for t in tables)
    table = torch.zeros(len(rows), width, dtype=torch.int64)
    for i, (seq, _) in enumerate(rows):
        table[i, : len(tables[seq])] = tables[seq]
    seq_lens = torch.tensor([pos + 1 for _, pos in rows], dtype=torch.int64)
    q = torch.stack([queries[seq][pos] for seq, pos in rows]).float().contiguous()
    return native.paged_decode_attention(q, keys, values, table, seq_lens, D**-0.5, path)


@pytest.mark.parametrize("pool_dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("path", kernels.ATTENTION_PATHS)
def test_a_rows_output_does_not_depend_on_its_neighbours(path, pool_dtype, native_kernels):
    if not kernels.attention_path_runs(path):
        pytest.skip(f"the {path} attention path does not run here")
    native_path = native_kernels.AttentionPath.__members__[path]
    pool = _pool(pool_dtype)
    queries = [torch.randn(n, HEADS, D).to(pool_dtype) for n in LENGTHS]
    seq = 0
    whole = _attend(native_kernels, native_path, pool, queries, [(seq, p) for p in range(LENGTHS[seq])])
    for chunk in (16, 64, 23, 1):  # chunked prefill; 1: decoded a token at a time
        pieces = [
            _attend(native_kernels, native_path, pool, queries, [(seq, p) for p in range(s, min(s + chunk, 150))])
            for s in range(0, LENGTHS[seq], chunk)
        ]
        assert torch.equal(torch.cat(pieces), whole), chunk
    # among other sequences' rows (decodes first, as a step packs them), in another order, a batch of 300 rows
    others = [(1, 36), (2, 89), (2, 10)]
    mixed_rows = others + [(seq, p) for p in range(LENGTHS[seq])] + [(1, p) for p in range(37)] + [(2, 5)] * 110
    mixed = _attend(native_kernels, native_path, pool, queries, mixed_rows)
    assert torch.equal(mixed[len(others) : len(others) + LENGTHS[seq]], whole)
    shuffled = torch.randperm(len(mixed_rows))
    again = _attend(native_kernels, native_path, pool, queries, [mixed_rows[i] for i in shuffled])
    assert torch.equal(again, mixed[shuffled])
    # and it is attention: one row against softmax(q k^T) v over its keys
    keys, values, tables = pool
    p = 100
    k = keys[tables[seq]].reshape(-1, KV_HEADS, D)[: p + 1].float().repeat_interleave(HEADS // KV_HEADS, 1)
    v = values[tables[seq]].reshape(-1, KV_HEADS, D)[: p + 1].float().repeat_interleave(HEADS // KV_HEADS, 1)
    weights = torch.softmax(torch.einsum("hd,thd->ht", queries[seq][p].float(), k) * D**-0.5, dim=-1)
    torch.testing.assert_close(whole[p], torch.einsum("ht,thd->hd", weights, v), atol=2e-2, rtol=2e-2)
