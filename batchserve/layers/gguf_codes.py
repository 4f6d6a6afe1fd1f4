"""A GGUF tensor's quantized blocks as the quantized GEMM's codes, scales and per-group minimums (quantization gguf:
the file's own values run as stored, repacked once at load, never re-quantized; docs/quantization.md).

Each type's blocks are decoded the way gguf.quants dequantizes them, into the kernels' layout (quant_gemm.h):

- Q8_0: int8 codes, group 32, scale d. Q4_0: its nibbles as they are (value (q - 8) * d), group 32.
- Q4_1 (value d * q + m) and Q4_K (8 sub-blocks of 32: d * sc * q - dmin * m): int4 group 32 with a minimum; the
  kernels subtract 8 from a nibble, so the minimum carries 8 scales (m + 8 d): one float32 rounding from gguf's
  value. Q4_K's nibbles (sub-block 2c in the low nibbles of 32 bytes, 2c + 1 in their high ones) are reordered.
- Q5_K (d * sc * q - dmin * m, q 0..31): int8 codes q, group 32, minimum -dmin * m: gguf's values bit for bit.
- Q6_K (d * sc * (q - 32), 16 sub-blocks of 16): int8 codes q - 32, group 16: gguf's values bit for bit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from batchserve.config import ConfigError
from batchserve.layers.quantization import QuantScheme, pack_int4, unpack_int4

QK_K = 256  # values per K-quant super-block


@dataclass
class StoredCodes:
    """A weight [N, K] in the kernels' layout; mins None where the format has none."""

    codes: torch.Tensor
    scales: torch.Tensor
    mins: torch.Tensor | None
    scheme: QuantScheme

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)


def _q8_0(b: np.ndarray):
    return b[:, 2:].view(np.int8).astype(np.int16), _f16(b[:, :2]), None, 8, 32


def _q4_0(b: np.ndarray):
    return _nibbles_q4(b[:, 2:]), _f16(b[:, :2]), None, 4, 32


def _q4_1(b: np.ndarray):
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return _nibbles_q4(b[:, 4:]), d, m + np.float32(8) * d, 4, 32


def _nibbles_q4(qs: np.ndarray) -> np.ndarray:
    """Q4_0/Q4_1's 16 bytes a block -> its 32 values 0..15 in k order (byte j: k = j low, k = j + 16 high)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


def _k_scales(b: np.ndarray):
    """A K-quant super-block's d * sc and dmin * m per sub-block of 32 [blocks, 8] (gguf's Q4_K.get_scale_min)."""
    from gguf.quants import Q4_K

    sc, m = Q4_K.get_scale_min(np.ascontiguousarray(b[:, 4:16]))
    return _f16(b[:, :2]) * sc.astype(np.float32), _f16(b[:, 2:4]) * m.astype(np.float32)


def _q4_k(b: np.ndarray):
    scale, dm = _k_scales(b)
    qs = b[:, 16:].reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)
    q = (qs & 15).reshape(-1, QK_K)
    return q, scale, np.float32(8) * scale - dm, 4, 32


def _q5_k(b: np.ndarray):
    scale, dm = _k_scales(b)
    qh, qs = b[:, 16:48], b[:, 48:]
    low = (qs.reshape(-1, 4, 1, 32) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
    high = (qh.reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)) & 1
    q = low.reshape(-1, 8, 32) | (high << 4)
    return q.reshape(-1, QK_K).astype(np.int16), scale, -dm, 8, 32


def _q6_k(b: np.ndarray):
    ql, qh, sc = b[:, :128], b[:, 128:192], b[:, 192:208].view(np.int8).astype(np.float32)
    low = (ql.reshape(-1, 2, 1, 64) >> np.array([0, 4], dtype=np.uint8).reshape(1, 1, 2, 1)) & 15
    high = (qh.reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 4, 1)) & 3
    q = low.reshape(-1, 8, 32).astype(np.int16) | (high.reshape(-1, 8, 32).astype(np.int16) << 4)
    return q.reshape(-1, QK_K) - 32, _f16(b[:, 208:210]) * sc, None, 8, 16


# type -> (bytes a block, values a block, decoder: blocks [B, bytes] -> (codes [B, values], scales [B, groups],
# mins or None, bits, group)); 4-bit codes are 0..15 (the kernels subtract 8), 8-bit ones signed
_DECODERS = {
    "Q8_0": (34, 32, _q8_0),
    "Q4_0": (18, 32, _q4_0),
    "Q4_1": (20, 32, _q4_1),
    "Q4_K": (144, QK_K, _q4_k),
    "Q5_K": (176, QK_K, _q5_k),
    "Q6_K": (210, QK_K, _q6_k),
}
TYPES_AS_STORED = tuple(_DECODERS)
FLOAT_TYPES = ("F32", "F16", "BF16")  # loaded as they are (not quantized) under quantization gguf too


def check_type(type_name: str, tensor_name: str = "") -> None:
    if type_name not in _DECODERS:
        where = f"GGUF tensor {tensor_name!r}" if tensor_name else "a GGUF tensor"
        raise ConfigError(
            f"quantization gguf: {where} has type {type_name}, which cannot be run as stored; "
            f"{', '.join(TYPES_AS_STORED)} can (or load the file with quantization none, int8 or int4: dequantized, "
            "then quantized again)"
        )


def repack(blocks: np.ndarray, type_name: str) -> StoredCodes:
    """A GGUF tensor's raw blocks [N, K / values a block * bytes a block] (uint8, as gguf.GGUFReader holds a quantized
    tensor) -> its StoredCodes. A type not in TYPES_AS_STORED is refused, naming it and what works."""
    check_type(type_name)
    block_bytes, block_values, decode = _DECODERS[type_name]
    n = blocks.shape[0]
    raw = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, block_bytes)
    values, scales, mins, bits, group = decode(raw)
    k = values.size // n
    values = torch.from_numpy(np.ascontiguousarray(values).reshape(n, k))
    codes = values.to(torch.int8) if bits == 8 else pack_int4(values)
    scheme = QuantScheme(bits, group)

    def per_row(groups: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(groups, dtype=np.float32).reshape(n, k // group))

    return StoredCodes(codes.contiguous(), per_row(scales), None if mins is None else per_row(mins), scheme)


# ---- concatenating a fused projection's parts (q/k/v, gate/up) -----------------------------------------------------


def concatenate(parts: list[StoredCodes]) -> StoredCodes:
    """The parts' rows stacked, in one layout all of them take exactly: 8 bits if any part has 8 (4-bit codes widened
    to code - 8), the smallest group (scales and mins repeated), a minimum of 0 where a part has none."""
    bits = max(p.scheme.bits for p in parts)
    group = min(p.scheme.group for p in parts)
    with_mins = any(p.mins is not None for p in parts)
    codes, scales, mins = [], [], []
    for part in parts:
        repeat = part.scheme.group // group
        codes.append(part.codes if part.scheme.bits == bits else (unpack_int4(part.codes) - 8).to(torch.int8))
        scales.append(part.scales.repeat_interleave(repeat, dim=1))
        if with_mins:
            part_mins = part.mins if part.mins is not None else torch.zeros_like(part.scales)
            mins.append(part_mins.repeat_interleave(repeat, dim=1))
    return StoredCodes(
        torch.cat(codes).contiguous(),
        torch.cat(scales).contiguous(),
        torch.cat(mins).contiguous() if with_mins else None,
        QuantScheme(bits, group),
    )


def permute_rows(stored: StoredCodes, rows: np.ndarray) -> StoredCodes:
    """The same weight with its output rows reordered (llama.cpp's q/k permutation undone)."""
    index = torch.from_numpy(rows)
    return StoredCodes(
        stored.codes[index].contiguous(),
        stored.scales[index].contiguous(),
        None if stored.mins is None else stored.mins[index].contiguous(),
        stored.scheme,
    )


def dequantize(stored: StoredCodes) -> torch.Tensor:
    """float32 [N, K]: code * scale (+ min) per value, as the kernels' dequantization forms it."""
    values = stored.codes.to(torch.int16) if stored.scheme.bits == 8 else unpack_int4(stored.codes) - 8
    group = stored.scheme.group
    out = values.float() * stored.scales.repeat_interleave(group, dim=1)
    return out if stored.mins is None else out + stored.mins.repeat_interleave(group, dim=1)
