"""Rotary position embeddings (HF rotate_half convention) with the frequency scalings of transformers'
modeling_rope_utils: linear, llama3, YaRN, dynamic NTK and LongRoPE, llama.cpp's per-frequency factors (a GGUF's
rope_freqs tensor), and partial rotary (a head's first rotary_dim dims).

Two scalings depend on the sequence in transformers: dynamic NTK and LongRoPE choose their frequencies from the
largest position of each forward call. Here a token's frequencies follow its own position (dynamic: the base for a
sequence of position + 1 tokens; LongRoPE: the long factors from original_max_position_embeddings on), which is what
transformers computes for every token of a generation whose prompt fits in the original length; the tokens of a
longer prompt, which transformers rotates all with the long frequencies, are the approximation (docs/models.md).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from batchserve.config import ModelConfig
from batchserve.layers import kernels

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "dynamic", "longrope", "freq_factors")
PER_TOKEN_ROPE_TYPES = ("dynamic", "longrope")  # their frequencies depend on each token's position


def rotary_dim(config: ModelConfig) -> int:
    return config.rotary_dim or config.head_dim


def _rope_type(config: ModelConfig) -> str:
    scaling = config.rope_scaling or {}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise NotImplementedError(f"rope_scaling type {rope_type!r} is not supported (only {SUPPORTED_ROPE_TYPES})")
    return rope_type


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2] in float32, as transformers' rope init function of the config's type
    computes them (LongRoPE: the short factors; dynamic: the unscaled ones, used up to max_position_embeddings)."""
    dim = rotary_dim(config)
    inv_freq = 1.0 / (config.rope_theta ** _exponents(dim))
    scaling = config.rope_scaling or {}
    rope_type = _rope_type(config)
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "yarn":
        return _yarn_inv_freq(config.rope_theta, dim, scaling, config.max_position_embeddings)
    if rope_type == "longrope":
        return _longrope_inv_freq(config.rope_theta, dim, scaling["short_factor"])
    if rope_type == "freq_factors":  # llama.cpp: theta / factor per frequency
        return inv_freq / torch.tensor(scaling["factors"], dtype=torch.float32)
    return inv_freq


def attention_scaling(config: ModelConfig) -> float:
    """The factor transformers multiplies cos and sin by (YaRN's mscale, LongRoPE's attention factor), else 1."""
    scaling = config.rope_scaling or {}
    rope_type = _rope_type(config)
    if rope_type == "yarn":
        factor = scaling.get("factor") or config.max_position_embeddings / scaling["original_max_position_embeddings"]
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            return float(_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim))
        return _yarn_mscale(factor)
    if rope_type == "longrope":
        if scaling.get("attention_factor") is not None:
            return float(scaling["attention_factor"])
        original = scaling["original_max_position_embeddings"]
        factor = scaling.get("factor") or config.max_position_embeddings / original
        return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return 1.0


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


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(base: float, dim: int, scaling: dict[str, Any], max_position_embeddings: int) -> torch.Tensor:
    """transformers' _compute_yarn_parameters: interpolated low frequencies, extrapolated high ones, a linear ramp
    between the dims that turn beta_slow and beta_fast times over the original context."""
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position_embeddings / original
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _longrope_inv_freq(base: float, dim: int, factors: list[float]) -> torch.Tensor:
    return 1.0 / (torch.tensor(factors, dtype=torch.float32) * base ** _exponents(dim))


def _dynamic_original(config: ModelConfig) -> int:
    """Where dynamic NTK starts growing the base: config.json's max_position_embeddings (models/hf_config.py keeps it
    in the scaling dict, ModelConfig.max_position_embeddings being the stretched context served)."""
    return config.rope_scaling.get("original_max_position_embeddings") or config.max_position_embeddings


def _dynamic_inv_freq(config: ModelConfig, positions: torch.Tensor) -> torch.Tensor:
    """[T, dim // 2]: each token's frequencies for a sequence of max(position + 1, original length) tokens
    (transformers' _compute_dynamic_ntk_parameters, in float32 as it computes them)."""
    dim, max_len = rotary_dim(config), _dynamic_original(config)
    factor = config.rope_scaling["factor"]
    seq_len = torch.clamp(positions + 1, min=max_len)
    base = config.rope_theta * ((factor * seq_len / max_len) - (factor - 1)) ** (dim / (dim - 2))
    return 1.0 / (base[:, None] ** _exponents(dim).to(positions.device)[None, :])


class RotaryEmbedding(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.rope_type = _rope_type(config)
        self.attention_scaling = attention_scaling(config)
        # on the CPU even when the model is built on the meta device (reset() moves them): a meta op runs Python
        # reference code that imports torch._dynamo, a second or more of an engine's start
        with torch.device("cpu"):
            self.register_buffer("inv_freq", rope_inv_freq(config), persistent=False)
            self.register_buffer("long_inv_freq", self._long_inv_freq(), persistent=False)

    def _long_inv_freq(self) -> torch.Tensor | None:
        if self.rope_type != "longrope":
            return None
        return _longrope_inv_freq(
            self.config.rope_theta, rotary_dim(self.config), self.config.rope_scaling["long_factor"]
        )

    def reset(self, device: torch.device) -> None:
        """Recompute the (non-loaded) frequencies once the module lives on its real device."""
        self.inv_freq = rope_inv_freq(self.config).to(device)
        long = self._long_inv_freq()
        self.long_inv_freq = None if long is None else long.to(device)

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype, long_context: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, rotary_dim / 2]: the two halves of a head share their angles. long_context (LongRoPE): which
        tokens belong to sequences past the original context (all their tokens take the long factors); without it,
        the tokens at positions past it."""
        pos = positions.float()[:, None]
        if self.rope_type == "dynamic":  # up to the original length transformers' unscaled frequencies, as they are
            grown = (positions >= _dynamic_original(self.config))[:, None]
            freqs = pos * torch.where(grown, _dynamic_inv_freq(self.config, positions), self.inv_freq[None, :])
        elif self.rope_type == "longrope":
            if long_context is None:
                long_context = positions >= self.config.rope_scaling["original_max_position_embeddings"]
            is_long = (long_context != 0)[:, None]
            freqs = pos * torch.where(is_long, self.long_inv_freq[None, :], self.inv_freq[None, :])
        else:
            freqs = pos * self.inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_scaling != 1.0:
            cos, sin = cos * self.attention_scaling, sin * self.attention_scaling
        return cos.to(dtype).contiguous(), sin.to(dtype).contiguous()


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


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on each head's first 2 * cos.shape[-1] dims, the rest passed through (Phi-4-mini's partial rotary)."""
    rot = 2 * cos.shape[-1]
    if rot == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat((apply_rope(x[..., :rot].contiguous(), cos, sin), x[..., rot:]), dim=-1)
