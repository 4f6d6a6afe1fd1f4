"""Paged attention in plain torch.

Each step's K/V are written into the block pool at `slot_mapping`; each sequence then attends over its whole context
(cached tokens + this step's chunk), read back from the pool through its block table. A batch may mix prefill chunks
(query length > 1) and decodes. Two paths: pure-decode steps (one query per sequence, GQA folded into the query dim,
no per-row mask) and the general path (queries padded per sequence, causal mask from absolute positions).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V, each [num_blocks, block_size, num_kv_heads, head_dim]


@dataclass
class AttentionMetadata:
    """Everything attention needs about one step's packed batch; built once per step, shared by all layers."""

    slot_mapping: torch.Tensor  # [T] int64: pool slot of each scheduled token
    positions: torch.Tensor  # [T] int64: absolute position of each scheduled token in its sequence
    block_tables: torch.Tensor  # [B, max_blocks] int64, padded with 0 (never read beyond seq_len)
    seq_lens: torch.Tensor  # [B] int64: context length after this step (computed + scheduled)
    query_start_loc: torch.Tensor  # [B + 1] int64: cu_seqlens of the packed queries
    max_query_len: int
    max_seq_len: int
    # [T] int64: index of each packed token in the [B * max_query_len] padded layout (general path only)
    query_pad_index: torch.Tensor | None = None
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def decode_only(self) -> bool:
        return self.max_query_len == 1

    def decode_mask(self, num_keys: int) -> torch.Tensor:
        """[B, 1, 1, num_keys] bool: key j is visible iff j < seq_len."""
        key = ("decode", num_keys)
        if key not in self._cache:
            arange = torch.arange(num_keys, device=self.seq_lens.device)
            self._cache[key] = (arange[None, :] < self.seq_lens[:, None])[:, None, None, :]
        return self._cache[key]

    def prefill_mask(self, num_keys: int) -> torch.Tensor:
        """[B, 1, max_q, num_keys] bool: query at position p sees keys 0..p of its own sequence.

        Padding rows get position 0, so they see key 0 and stay finite; their output is dropped.
        """
        key = ("prefill", num_keys)
        if key not in self._cache:
            assert self.query_pad_index is not None, "general attention path needs query_pad_index"
            pos = self.positions.new_zeros(self.num_seqs * self.max_query_len)
            pos[self.query_pad_index] = self.positions
            arange = torch.arange(num_keys, device=pos.device)
            mask = arange[None, None, :] <= pos.view(self.num_seqs, self.max_query_len, 1)
            self._cache[key] = mask[:, None]
        return self._cache[key]


def write_kv(key: torch.Tensor, value: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
    """Store this step's K/V ([T, Hkv, D]) into the pool at their slots."""
    key_cache, value_cache = kv_cache
    num_kv_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    key_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, key.to(key_cache.dtype))
    value_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, value.to(value_cache.dtype))


def gather_kv(kv_cache: KVCache, block_tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Read each sequence's context through its block table -> K, V as [B, Hkv, max_blocks * block_size, D]."""
    key_cache, value_cache = kv_cache
    num_seqs, max_blocks = block_tables.shape
    _, block_size, num_kv_heads, head_dim = key_cache.shape
    flat = block_tables.reshape(-1)
    keys = key_cache.index_select(0, flat).view(num_seqs, max_blocks * block_size, num_kv_heads, head_dim)
    values = value_cache.index_select(0, flat).view(num_seqs, max_blocks * block_size, num_kv_heads, head_dim)
    return keys.transpose(1, 2), values.transpose(1, 2)


def paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: KVCache,
    metadata: AttentionMetadata,
    scale: float | None = None,
) -> torch.Tensor:
    """query [T, H, D], key/value [T, Hkv, D] (this step's tokens, packed) -> output [T, H, D]."""
    write_kv(key, value, kv_cache, metadata.slot_mapping)
    keys, values = gather_kv(kv_cache, metadata.block_tables)
    if metadata.decode_only:
        return _decode_attention(query, keys, values, metadata, scale)
    return _general_attention(query, keys, values, metadata, scale)


def _decode_attention(query, keys, values, metadata: AttentionMetadata, scale):
    # One query per sequence: fold the query heads sharing a KV head into SDPA's query-length dim (GQA, no copy).
    num_seqs, num_kv_heads, num_keys, head_dim = keys.shape
    num_heads = query.shape[1]
    q = query.view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_dim)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=metadata.decode_mask(num_keys), scale=scale)
    return out.reshape(num_seqs, num_heads, head_dim)


def _general_attention(query, keys, values, metadata: AttentionMetadata, scale):
    num_seqs, num_kv_heads, num_keys, head_dim = keys.shape
    num_tokens, num_heads, _ = query.shape
    max_q = metadata.max_query_len
    padded = query.new_zeros(num_seqs * max_q, num_heads, head_dim)
    padded[metadata.query_pad_index] = query
    q = padded.view(num_seqs, max_q, num_heads, head_dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q,
        keys,
        values,
        attn_mask=metadata.prefill_mask(num_keys),
        scale=scale,
        enable_gqa=num_heads != num_kv_heads,
    )
    out = out.transpose(1, 2).reshape(num_seqs * max_q, num_heads, head_dim)
    return out[metadata.query_pad_index]
