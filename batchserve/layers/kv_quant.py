"""The 8-bit KV caches (kv_cache_dtype "int8" or "fp8_e4m3"): K/V codes with one float32 scale per (slot, KV head).

A layer's pool is a QuantizedKV: the (K, V) pair of code tensors (int8 or float8_e4m3fn) that every reader indexes as
kv_cache[0] and kv_cache[1], carrying the two scale tensors beside it. A token's K (and its V) of one head is stored
as code(x / s) with s = max|x| / (the code type's largest magnitude): int8 rounds to the nearest integer (each
element off by at most s / 2), float8 e4m3 to the nearest of its values (3 mantissa bits: off by at most 1/16 of the
element's magnitude, or s / 1024 near zero).
"""

from __future__ import annotations

import torch

from batchserve.host import huge_pages
from batchserve.layers import kernels

CODE_DTYPES = (torch.int8, torch.float8_e4m3fn)
QMAX = {torch.int8: 127.0, torch.float8_e4m3fn: torch.finfo(torch.float8_e4m3fn).max}  # 448 for e4m3
SCALE_DTYPE = torch.float32
# A head whose K (or V) is all zeros gets this scale instead of 0 (which would divide by zero); it reads back as zeros.
MIN_SCALE = 1e-12


class QuantizedKV(tuple):
    """(K, V) code pools [num_blocks, block_size, Hkv, D] (int8 or float8 e4m3) with their scales
    [num_blocks, block_size, Hkv]."""

    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def __new__(cls, key: torch.Tensor, value: torch.Tensor, k_scale: torch.Tensor, v_scale: torch.Tensor):
        pair = super().__new__(cls, (key, value))
        pair.k_scale, pair.v_scale = k_scale, v_scale
        return pair

    @classmethod
    def zeros(
        cls, shape: tuple[int, ...], device: torch.device, pin: bool = False, dtype: torch.dtype = torch.int8
    ) -> QuantizedKV:
        """A pool of `shape` (num_blocks, block_size, Hkv, D) of `dtype` codes: zeros dequantize to zeros (never
        NaN)."""
        if pin:
            data = [torch.zeros(shape, dtype=dtype, pin_memory=True) for _ in range(2)]
            scales = [torch.zeros(shape[:-1], dtype=SCALE_DTYPE, pin_memory=True) for _ in range(2)]
        else:  # read whole at every step: on 2 MiB pages where the host allows
            data = [huge_pages.zeros(shape, dtype, device) for _ in range(2)]
            scales = [huge_pages.zeros(shape[:-1], SCALE_DTYPE, device) for _ in range(2)]
        return cls(*data, *scales)

    def parts(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """K, V and their scales: what a copy of blocks (swap, resize) must move together; codes as their bytes
        (torch's CPU index_copy_ takes no float8)."""
        return as_bytes(self[0]), as_bytes(self[1]), self.k_scale, self.v_scale


def as_bytes(codes: torch.Tensor) -> torch.Tensor:
    """Codes as uint8 of the same bytes, for the copies torch does not implement for float8 (index_copy_)."""
    return codes.view(torch.uint8) if codes.dtype == torch.float8_e4m3fn else codes


def is_quantized(kv_cache) -> bool:
    return isinstance(kv_cache, QuantizedKV)


def quantize(x: torch.Tensor, dtype: torch.dtype = torch.int8) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (codes of dtype [..., D], float32 scale [...]): symmetric, one scale per row of D."""
    x = x.float()
    scale = (x.abs().amax(dim=-1) / QMAX[dtype]).clamp_min(MIN_SCALE)
    scaled = x / scale.unsqueeze(-1)
    if dtype == torch.int8:
        return torch.round(scaled).clamp_(-QMAX[dtype], QMAX[dtype]).to(dtype), scale
    return scaled.to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The inverse of quantize, to within scale / 2 per element."""
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def write(
    key: torch.Tensor, value: torch.Tensor, kv_cache: QuantizedKV, slot_mapping: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize this step's K/V ([T, Hkv, D]) and store them with their scales at their slots -> the K/V as stored
    (dequantized, in their dtype), which this step attends to so that a prompt sees what its later chunks will."""
    num_kv_heads, head_dim = kv_cache[0].shape[2], kv_cache[0].shape[3]
    stored = []
    for x, data, scales in ((key, kv_cache[0], kv_cache.k_scale), (value, kv_cache[1], kv_cache.v_scale)):
        q, s = quantize(x, data.dtype)
        as_bytes(data).view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, as_bytes(q))
        scales.view(-1, num_kv_heads).index_copy_(0, slot_mapping, s)
        stored.append(dequantize(q, s, x.dtype))
    return stored[0], stored[1]


def read_blocks(kv_cache: QuantizedKV, blocks: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V of the given block ids, dequantized -> each [len(blocks), block_size, Hkv, D] in `dtype`."""
    return (
        dequantize(kv_cache[0].index_select(0, blocks), kv_cache.k_scale.index_select(0, blocks), dtype),
        dequantize(kv_cache[1].index_select(0, blocks), kv_cache.v_scale.index_select(0, blocks), dtype),
    )


def dequantized_pool(kv_cache: QuantizedKV, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole pool dequantized (tests' reference: float attention over exactly the values int8 stores)."""
    return dequantize(kv_cache[0], kv_cache.k_scale, dtype), dequantize(kv_cache[1], kv_cache.v_scale, dtype)


def native_decode(
    query: torch.Tensor, kv_cache: QuantizedKV, block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float
) -> torch.Tensor | None:
    """Decode attention reading the pool's codes in place on the native attention path (kernels/decode_quantized_kv.cpp: each
    key row's scale on its q.k, each value row's on its weight) -> [B, H, D] in the query's dtype; None off the CPU or
    without native kernels."""
    if query.device.type != "cpu" or kernels.load() is None:
        return None
    out = torch.ops.batchserve_kv_quant.paged_decode(
        query.float().contiguous(), kv_cache[0], kv_cache[1], kv_cache.k_scale, kv_cache.v_scale,
        block_tables, seq_lens, scale, int(kernels.attention_path()),
    )  # fmt: skip
    return out.to(query.dtype)
