"""What a model computes, as named features. A model's capabilities are read off its modules' op plan
(layers/op_plan.py capabilities): each module that computes a feature contributes the op that names it, so a feature
is declared once, where it is computed. They tell a reader (and the CUDA graph capture, which skips MoE models) what a
model does; which runner takes the model is decided by the plan's op kinds (op_plan.native_loop)."""

from __future__ import annotations

import enum


class Capability(str, enum.Enum):
    ROPE = "rope"  # rotary position embeddings on q and k
    RMS_NORM = "rms_norm"  # RMSNorm before attention and MLP, the residual add fused in
    GQA = "gqa"  # fewer kv heads than query heads
    SWIGLU = "swiglu"  # silu(gate) * up MLP
    QKV_BIAS = "qkv_bias"  # a bias on the q/k/v projection
    O_BIAS = "o_bias"  # a bias on the output projection
    TIED_EMBEDDINGS = "tied_embeddings"  # the embedding table is the output matrix
    QK_NORM = "qk_norm"  # a norm on q and k per head before RoPE
    PARTIAL_ROTARY = "partial_rotary"  # RoPE on a head's first dims only (Phi-4-mini)
    SLIDING_WINDOW = "sliding_window"  # attention to the last W tokens only
    SOFTCAP = "softcap"  # tanh soft-capping of attention scores or logits
    MOE = "moe"  # a mixture-of-experts MLP
    GEGLU = "geglu"  # gelu(gate, tanh approximation) * up MLP (Gemma)
    SANDWICH_NORM = "sandwich_norm"  # (1 + w) RMSNorms after attention and MLP too, scaled embeddings (Gemma)
