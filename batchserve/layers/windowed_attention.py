"""Paged attention for layers with a sliding window and/or tanh soft-capped scores (Mistral, Gemma 2/3): torch code,
any device, called by attention.paged_attention once this step's K/V are in the pool.

A windowed layer's query at position p sees the keys at positions p - W < j <= p, transformers' convention
(masking_utils.sliding_window_overlay: kv_idx > q_idx - sliding_window), so W keys, itself included. Only the blocks
that hold such keys are read through the block table: a block that has left the window may have gone back to the pool
and its table entry may be stale, so it is never touched. Soft-capping follows Gemma 2: scores = cap * tanh(scores /
cap), applied after the scale and before the mask.

The native attention kernels take neither (their decode and prefill loops read a sequence's context from position 0,
with no start offset and no cap): the Python layers run this code, and the native decoder loop the same ATen calls in
the same order (kernels/composed_ops.cpp windowed_attention). A change here is a change there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from batchserve.layers.attention import AttentionMetadata, KVCache, SeqGroup

QUERY_TILE = 256  # prefill query rows attended at once: bounds the score matrix to QUERY_TILE x (window + QUERY_TILE)


def windowed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: KVCache,
    metadata: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, Hkv, D] (already written to the pool) -> output [T, H, D]."""
    out = torch.empty_like(query)
    for group in (metadata.decode, metadata.prefill):
        if group is None:
            continue
        rows = slice(*group.token_range)
        if group.spans is None:  # one query per sequence
            out[rows] = _decode(query[rows], kv_cache, group, scale, window, softcap)
        else:
            out[rows] = _prefill(query[rows], key[rows], value[rows], kv_cache, group, scale, window, softcap)
    return out


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float | None
) -> torch.Tensor:
    """q [..., Hkv, G, Q, D] (G query heads per KV head), k/v [..., K, Hkv, D] as read from the pool, mask [..., Q, K]
    (True: visible) -> [..., Hkv, G, Q, D]. One KV head at a time: its K/V are a strided view the batched GEMM reads in
    place (a [..., Hkv, K, D] copy of the whole context would cost more than the attention), its G query heads folded
    into the query dim. Scores in the query dtype, capped, masked, softmax in float32: transformers' eager attention."""
    *lead, num_kv_heads, groups, num_queries, head_dim = q.shape
    out = torch.empty_like(q)
    hidden = ~mask.unsqueeze(-3)  # [..., 1, Q, K]: the same for the G heads
    for h in range(num_kv_heads):
        q_h = q[..., h, :, :, :].reshape(*lead, groups * num_queries, head_dim)
        scores = torch.matmul(q_h, k[..., h, :].transpose(-1, -2)) * scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        scores = scores.view(*lead, groups, num_queries, -1).masked_fill(hidden, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
        out[..., h, :, :, :] = torch.matmul(probs.flatten(-3, -2), v[..., h, :]).view(*lead, groups, num_queries, -1)
    return out


def _decode(
    query: torch.Tensor, kv_cache: KVCache, group: SeqGroup, scale: float, window: int | None, softcap: float | None
) -> torch.Tensor:
    """One query per sequence, at position seq_len - 1, over the blocks that hold its window."""
    tables, mask = _decode_window(group, kv_cache[0].shape[1], window)
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache[0].shape[2]
    keys, values = (_gather(cache, tables, query.dtype) for cache in kv_cache)  # [B, K, Hkv, D]
    q = query.reshape(num_seqs, num_kv_heads, num_heads // num_kv_heads, 1, head_dim)
    out = attend(q, keys, values, mask, scale, softcap)
    return out.reshape(num_seqs, num_heads, head_dim)


def _decode_window(group: SeqGroup, block_size: int, window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per sequence, the block ids that hold its window ([B, span]) and which of their slots its query sees
    ([B, 1, span * block_size]); computed once a step per window and shared by the layers."""
    cache_key = ("window-decode", window, block_size)
    if cache_key not in group._masks:
        seq_lens, tables = group.seq_lens, group.block_tables
        max_blocks = tables.shape[1]
        if window is None:
            first, span = torch.zeros_like(seq_lens), max_blocks
        else:
            first = (seq_lens - window).clamp(min=0) // block_size
            span = min(max_blocks, -(-window // block_size) + 1)
        index = first[:, None] + torch.arange(span, device=seq_lens.device)[None, :]
        # past a sequence's last block, its last block again (masked by position): the table's padding entries may
        # name any block, one another request is writing or one that holds no numbers yet
        last = ((seq_lens - 1) // block_size)[:, None]
        window_tables = tables.gather(1, torch.minimum(index, last))
        slots = torch.arange(block_size, device=seq_lens.device)
        key_pos = (index[:, :, None] * block_size + slots).flatten(1)
        mask = _visible(key_pos, (seq_lens - 1)[:, None], window)
        group._masks[cache_key] = (window_tables, mask[:, None, :])
    return group._masks[cache_key]


def _visible(key_pos: torch.Tensor, query_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal, and within the window: key j is visible to the query at p iff j <= p and j > p - window."""
    mask = key_pos <= query_pos
    return mask if window is None else mask & (key_pos > query_pos - window)


def _prefill(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: KVCache,
    group: SeqGroup,
    scale: float,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Each sequence's chunk (positions context .. context + n - 1) in tiles of query rows, each tile over only the
    keys its window reaches: this step's own K/V for a fresh prompt, else read from the pool."""
    out = torch.empty_like(query)
    num_heads, head_dim = query.shape[1:]
    num_kv_heads = key.shape[1]
    for i, (start, stop, context) in enumerate(group.spans):
        for a in range(start, stop, QUERY_TILE):
            b = min(a + QUERY_TILE, stop)
            first_pos, end_pos = context + a - start, context + b - start  # this tile's query positions
            lo = 0 if window is None else max(0, first_pos - window + 1)
            if context == 0:
                k, v = key[start + lo : start + end_pos], value[start + lo : start + end_pos]
            else:
                k, v = _sequence_range(kv_cache, group.block_tables[i], lo, end_pos, query.dtype)
            query_pos = torch.arange(first_pos, end_pos, device=query.device)[:, None]
            mask = _visible(torch.arange(lo, end_pos, device=query.device)[None, :], query_pos, window)
            q = query[a:b].reshape(b - a, num_kv_heads, num_heads // num_kv_heads, head_dim).permute(1, 2, 0, 3)
            o = attend(q, k, v, mask, scale, softcap)
            out[a:b] = o.permute(2, 0, 1, 3).reshape(b - a, num_heads, head_dim)
    return out


def _gather(cache: torch.Tensor, tables: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Blocks [B, span] of a pool [N, block_size, Hkv, D] -> [B, span * block_size, Hkv, D]."""
    num_seqs, span = tables.shape
    block_size, num_kv_heads, head_dim = cache.shape[1:]
    blocks = cache.index_select(0, tables.reshape(-1)).view(num_seqs, span * block_size, num_kv_heads, head_dim)
    return blocks.to(dtype)


def _sequence_range(
    kv_cache: KVCache, block_table: torch.Tensor, lo: int, hi: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's K and V at positions lo .. hi - 1, read through its block table -> each [hi - lo, Hkv, D]."""
    block_size, num_kv_heads, head_dim = kv_cache[0].shape[1:]
    first, last = lo // block_size, -(-hi // block_size)
    blocks = block_table[first:last]
    offset = lo - first * block_size
    return tuple(
        cache.index_select(0, blocks).view(-1, num_kv_heads, head_dim)[offset : offset + hi - lo].to(dtype)
        for cache in kv_cache
    )
