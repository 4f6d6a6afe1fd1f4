"""What a model's layers compute, as an explicit list: a model declares its capabilities, and a runner of layers
(the native decoder loop) runs a model only if it implements every one of them. A feature added to a model's Python
layers is declared here first, so that no runner that lacks it can skip it silently."""

from __future__ import annotations

import enum
from collections.abc import Iterable


class Capability(str, enum.Enum):
    ROPE = "rope"  # rotary position embeddings on q and k
    RMS_NORM = "rms_norm"  # RMSNorm before attention and MLP, the residual add fused in
    GQA = "gqa"  # fewer kv heads than query heads
    SWIGLU = "swiglu"  # silu(gate) * up MLP
    QKV_BIAS = "qkv_bias"  # a bias on the q/k/v projection
    O_BIAS = "o_bias"  # a bias on the output projection
    TIED_EMBEDDINGS = "tied_embeddings"  # the embedding table is the output matrix
    # not computed by the native decoder loop yet
    QK_NORM = "qk_norm"  # a norm on q and k per head before RoPE
    PARTIAL_ROTARY = "partial_rotary"  # RoPE on a head's first dims only (Phi-4-mini)
    SLIDING_WINDOW = "sliding_window"  # attention to the last W tokens only
    SOFTCAP = "softcap"  # tanh soft-capping of attention scores or logits
    MOE = "moe"  # a mixture-of-experts MLP
    GEGLU = "geglu"  # gelu(gate, tanh approximation) * up MLP (Gemma)
    SANDWICH_NORM = "sandwich_norm"  # (1 + w) RMSNorms after attention and MLP too, scaled embeddings (Gemma)


def missing(declared: Iterable[Capability], implemented: Iterable[str]) -> list[str]:
    """The declared capabilities that `implemented` (capability values) lacks, sorted by name."""
    have = set(implemented)
    return sorted(c.value for c in declared if c.value not in have)
