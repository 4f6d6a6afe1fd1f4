"""Gemma 2 and Gemma 3 (text) decoders over packed tokens and a paged KV cache.

What differs from the Llama family (models/llama.py, whose projections, weight loading and output matrix are reused):
- RMSNorms scale by (1 + w): the checkpoint's w is loaded, then 1 is added once, so the shared RMSNorm operator runs;
- four norms a layer: after attention and after the MLP too, before each residual add ("sandwich" norms);
- GeGLU MLP (gelu, tanh approximation), embeddings scaled by sqrt(hidden_size), attention scaled by
  query_pre_attn_scalar ** -0.5 instead of head_dim ** -0.5;
- interleaved sliding-window and global layers (`layer_types`; Gemma 2 alternates, Gemma 3 has one global layer in
  six), the windowed ones through layers/windowed_attention.py;
- Gemma 2: attention scores and final logits soft-capped (cap * tanh(x / cap));
- Gemma 3: an RMSNorm on q and k per head before RoPE, and per-layer RoPE: sliding layers rotate with
  rope_local_base_freq and no scaling, global layers with rope_theta and the checkpoint's rope scaling; final logit
  soft-capping when the config sets it (transformers' Gemma 3 never soft-caps attention scores, nor do we).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from batchserve.config import ModelConfig
from batchserve.layers.activation import GeGLUMLP
from batchserve.layers.attention import AttentionMetadata, KVCache
from batchserve.layers.capabilities import Capability
from batchserve.layers.embedding import token_embedding
from batchserve.layers.linear import CpuLinear
from batchserve.layers.norm import RMSNorm
from batchserve.layers.op_plan import LayerPlan, OpKind, norm_op
from batchserve.layers.rotary import RotaryEmbedding
from batchserve.models.llama import Attention, LlamaForCausalLM
from batchserve.models.registry import ArchitectureSpec, register

logger = logging.getLogger(__name__)

SLIDING, FULL = "sliding_attention", "full_attention"
ROPE_TABLES = (FULL, SLIDING)  # the order of GemmaForCausalLM.rope_tables


@dataclass(frozen=True)
class GemmaSettings:
    """What a Gemma config sets beyond ModelConfig's Llama-family shapes (kept in ModelConfig.extra)."""

    version: int  # 2 or 3
    layer_types: tuple[str, ...]  # SLIDING or FULL, one per layer
    sliding_window: int | None
    query_pre_attn_scalar: float
    attn_softcap: float | None  # Gemma 2 only
    final_softcap: float | None
    local_rope_theta: float  # sliding layers' RoPE base (Gemma 3; Gemma 2's layers all use rope_theta)

    @classmethod
    def of(cls, config: ModelConfig) -> GemmaSettings:
        extra = {f.name: config.extra[f.name] for f in dataclasses.fields(cls)}
        return cls(**{**extra, "layer_types": tuple(extra["layer_types"])})  # a list once through JSON


def config_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 2 / Gemma 3 text config.json -> the ModelConfig fields it sets beyond the common ones (the Gemma
    settings go in `extra`). Reads transformers 4's (rope_theta, rope_scaling, rope_local_base_freq,
    sliding_window_pattern) and 5's (rope_parameters per layer type) spellings."""
    version = 2 if hf.get("model_type") == "gemma2" else 3
    num_layers = hf["num_hidden_layers"]
    pattern = 2 if version == 2 else hf.get("sliding_window_pattern", 6)
    layer_types = hf.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(num_layers)]
    full, local = _rope_parameters(hf, version)
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    extra = dict(
        version=version,
        layer_types=tuple(layer_types),
        sliding_window=hf.get("sliding_window") if SLIDING in layer_types else None,
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar") or head_dim),
        attn_softcap=hf.get("attn_logit_softcapping") if version == 2 else None,
        final_softcap=hf.get("final_logit_softcapping"),
        local_rope_theta=float(local.get("rope_theta", 10000.0)),
    )
    scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    if scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    else:
        scaling.setdefault("rope_type", scaling.get("type"))
    return dict(
        head_dim=head_dim,
        rope_theta=float(full.get("rope_theta", 10000.0)),
        rope_scaling=scaling,
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", True)),
        attention_bias=bool(hf.get("attention_bias", False)),
        extra=extra,
    )


def _rope_parameters(hf: dict[str, Any], version: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """(global layers' RoPE parameters, sliding layers'), rope_theta included in each."""
    params = hf.get("rope_parameters") or {}
    if FULL in params:  # transformers 5, Gemma 3: one dict per layer type
        return dict(params[FULL]), dict(params.get(SLIDING) or {})
    if params:  # transformers 5, Gemma 2: one dict for all layers
        return dict(params), dict(params)
    full = dict(hf.get("rope_scaling") or {})
    full["rope_theta"] = hf.get("rope_theta", 1_000_000.0 if version == 3 else 10000.0)
    local_theta = hf.get("rope_local_base_freq", 10000.0) if version == 3 else full["rope_theta"]
    return full, {"rope_theta": local_theta}


class GemmaRMSNorm(RMSNorm):
    """The shared RMSNorm, its weight holding 1 + w once loaded (GemmaForCausalLM.load_weights adds the 1). Off the
    native kernel a low-precision input is scaled in float32 and rounded once, Gemma's order ((x * w).to(dtype))."""

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return super()._norm(x)
        return F.rms_norm(x.float(), self.weight.shape, self.weight.float(), self.eps).to(x.dtype)


class GemmaAttention(Attention):
    def __init__(self, config: ModelConfig, layer_type: str, dtype: torch.dtype | None = None):
        super().__init__(config, dtype)
        settings = GemmaSettings.of(config)
        self.layer_type = layer_type
        self.scale = settings.query_pre_attn_scalar**-0.5
        self.window = settings.sliding_window if layer_type == SLIDING else None
        self.softcap = settings.attn_softcap
        self.rope_table = ROPE_TABLES.index(layer_type)
        self.q_norm = self.k_norm = None
        if settings.version == 3:
            self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps, dtype)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, layer_type: str, dtype: torch.dtype | None = None):
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.layer_type = layer_type
        self.input_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.self_attn = GemmaAttention(config, layer_type, dtype)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)
        self.mlp = GeGLUMLP(config, dtype)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps, dtype)

    def ops(self) -> LayerPlan:
        """The Llama layer's ops with a NORM after each sublayer (layers/op_plan.py)."""
        return [
            norm_op(OpKind.RESIDUAL_NORM, self.input_layernorm),
            *self.self_attn.ops(),
            norm_op(OpKind.NORM, self.post_attention_layernorm),
            norm_op(OpKind.RESIDUAL_NORM, self.pre_feedforward_layernorm),
            self.mlp.op(),
            norm_op(OpKind.NORM, self.post_feedforward_layernorm),
        ]

    def forward(self, x, residual, cos, sin, kv_cache: KVCache, attn_metadata: AttentionMetadata):
        """(x, residual) -> (x, residual) of the next layer, the stream being x + residual (None at layer 0): each
        residual add is fused into the pre-norm that follows it; the post-norms see only their sublayer's output."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.post_attention_layernorm(self.self_attn(h, cos, sin, kv_cache, attn_metadata))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h, attn_metadata.lora)), residual


class LayerRotary(nn.Module):
    """The RoPE tables of both layer types: global layers with the config's base and scaling, sliding ones with the
    local base and no scaling (the same angles for both in Gemma 2)."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        local = dataclasses.replace(config, rope_theta=GemmaSettings.of(config).local_rope_theta, rope_scaling=None)
        self.full = RotaryEmbedding(config)
        self.sliding = RotaryEmbedding(local)

    def reset(self, device: torch.device) -> None:
        self.full.reset(device)
        self.sliding.reset(device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {FULL: self.full(positions, dtype), SLIDING: self.sliding(positions, dtype)}


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2 / Gemma 3 text: the Llama model's forward and native decoder loop over Gemma's layers (their op plan
    has GeGLU, sandwich norms, windows and soft-caps), a scaled embedding and one RoPE table per layer type."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        nn.Module.__init__(self)
        self.config = config
        self.settings = GemmaSettings.of(config)
        self.embed_tokens = token_embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(GemmaDecoderLayer(config, kind, dtype) for kind in self.settings.layer_types)
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary = LayerRotary(config)
        self.lm_head = None
        if not config.tie_word_embeddings:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.output_proj: CpuLinear | None = None
        self.decoder_loop = None

    def model_level_capabilities(self) -> set[Capability]:
        final_softcap = {Capability.SOFTCAP} if self.settings.final_softcap is not None else set()
        return super().model_level_capabilities() | final_softcap

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        return x * torch.tensor(self.config.hidden_size**0.5, dtype=x.dtype)  # rounded to the dtype, as transformers

    def rope_tables(self, positions: torch.Tensor, dtype: torch.dtype, attn_metadata) -> list:
        tables = self.rotary(positions, dtype)
        return [tables[kind] for kind in ROPE_TABLES]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        cap = self.settings.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """HF-named tensors as the Llama family's (q/k/v and gate/up fused), then 1 added to every norm's weight."""
        super().load_weights(weights)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, GemmaRMSNorm):
                    module.weight.add_(1.0)


for _spec in (
    ArchitectureSpec("gemma2", ("Gemma2ForCausalLM",), ("gemma2",), "batchserve.models.gemma:GemmaForCausalLM", config_fields,
                     "exact (soft-capping, sliding/global layers, sandwich norms)"),
    ArchitectureSpec("gemma3_text", ("Gemma3ForCausalLM",), ("gemma3",), "batchserve.models.gemma:GemmaForCausalLM",
                     config_fields, "exact, text only (q/k norms, per-layer RoPE bases)"),
):  # fmt: skip
    register(_spec)
