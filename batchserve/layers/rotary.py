"""Rotary position embeddings (HF rotate_half convention) with linear and llama3 frequency scaling."""

from __future__ import annotations

import math

import torch
from torch import nn

from batchserve.config import ModelConfig
from batchserve.layers import kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in float32, with HF's linear / llama3 scaling applied."""
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type != "default":
        raise NotImplementedError(f"rope_scaling type {rope_type!r} is not supported (only {SUPPORTED_ROPE_TYPES})")
    return inv_freq


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict) -> torch.Tensor:
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)

    def reset(self, device: torch.device) -> None:
        """Recompute the (non-loaded) frequencies once the module lives on its real device."""
        self.inv_freq = rope_inv_freq(self.config).to(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, D/2]: the two halves of a head share their angles."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        return freqs.cos().to(dtype).contiguous(), freqs.sin().to(dtype).contiguous()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D]; cos/sin [T, D/2]. HF rotate_half: (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin).
    The native kernel rotates x in place (its heads must be contiguous within a token)."""
    native = kernels.for_tensors(x, cos, dtypes=kernels.FUSED_DTYPES)
    if native is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        native.rope_(x, cos, sin)
        return x
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
