"""One Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2/2.5, Qwen3, Phi-3/3.5/4-mini) over packed tokens
and a paged KV cache.

RMSNorm, RoPE (HF rotate_half convention, the scalings of layers/rotary.py, partial rotary), GQA, SwiGLU, Qwen3's
per-head q/k RMSNorm. Q/K/V are one Linear and gate/up are one Linear: the loader concatenates the checkpoint's
separate weights into them, or copies Phi-3's already fused ones (`load_weights`). The architectures register
themselves in models/registry.py at the end of this module.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from batchserve import env
from batchserve.config import ModelConfig
from batchserve.layers import kernels, op_plan
from batchserve.layers.attention import AttentionMetadata, KVCache, native_step, paged_attention, quantized_kv_scales
from batchserve.layers.capabilities import Capability
from batchserve.layers.embedding import token_embedding
from batchserve.layers.linear import CpuLinear, loading_policy
from batchserve.layers.lora import project
from batchserve.layers.mlp import MLP
from batchserve.layers.norm import RMSNorm
from batchserve.layers.op_plan import LayerPlan, Op, OpKind, norm_op
from batchserve.layers.rotary import RotaryEmbedding, apply_partial_rope, rotary_dim
from batchserve.layers.windowed_attention import QUERY_TILE
from batchserve.models.hf_config import qwen_window_fields
from batchserve.models.registry import ArchitectureSpec, ModelLoadError, register

logger = logging.getLogger(__name__)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None, layer_index: int = 0):
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        # Qwen2: bias on q/k/v only; Llama's attention_bias also puts one on o_proj.
        o_bias = config.attention_bias and config.architecture != "qwen2"
        self.qkv_proj = nn.Linear(
            config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.attention_bias, dtype=dtype
        )
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=o_bias, dtype=dtype)
        self.scale = self.head_dim**-0.5
        self.window = config.sliding_window
        if layer_index in config.extra.get("windowed_layers", ()):  # Qwen's use_sliding_window on some layers
            self.window = config.extra["layer_window"]
        self.softcap: float | None = None  # tanh soft-capping of the scores (Gemma 2)
        self.rotary_dims = rotary_dim(config)  # Phi-4-mini: fewer than head_dim
        self.rope_table = 0  # which of the model's RoPE tables this layer rotates with (Gemma: per layer type)
        self.q_norm = self.k_norm = None
        if config.qk_norm:  # Qwen3
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, dtype)

    def ops(self) -> LayerPlan:
        """What forward runs, as op plan ops (layers/op_plan.py): a q/k norm inserts QK_NORM; the rotary dims, window
        and soft-cap are arguments of ROPE and ATTENTION."""
        shape = (self.num_heads, self.num_kv_heads, self.head_dim)
        ops = [Op(OpKind.QKV, linears=(self.qkv_proj,), ints=shape)]
        if self.q_norm is not None:
            norms = (self.q_norm.weight, self.k_norm.weight)
            ops.append(Op(OpKind.QK_NORM, tensors=norms, ints=shape, floats=(self.q_norm.eps,)))
        return [
            *ops,
            Op(OpKind.ROPE, ints=(self.rope_table, self.rotary_dims, self.head_dim)),
            Op(OpKind.ATTENTION, ints=(*shape, self.window or 0, QUERY_TILE), floats=(self.scale, self.softcap or 0.0)),
            Op(OpKind.O_PROJ, linears=(self.o_proj,)),
        ]

    def forward(self, x, cos, sin, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        lora = attn_metadata.lora
        qk, v = project(self.qkv_proj, x, lora).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(num_tokens, self.num_heads, self.head_dim)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(num_tokens, self.num_kv_heads, self.head_dim)
            qk = torch.cat((q, k), dim=1)
        # q and k heads rotate together: one RoPE pass instead of two
        qk = apply_partial_rope(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(
            q, k, v, kv_cache, attn_metadata, scale=self.scale, window=self.window, softcap=self.softcap
        )
        return project(self.o_proj, out.reshape(num_tokens, self.q_size), lora)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None, layer_index: int = 0):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def ops(self) -> LayerPlan:
        return [
            norm_op(OpKind.RESIDUAL_NORM, self.input_layernorm),
            *self.self_attn.ops(),
            norm_op(OpKind.RESIDUAL_NORM, self.post_attention_layernorm),
            self.mlp.op(),
        ]

    def forward(self, x, residual, cos, sin, kv_cache: KVCache, attn_metadata: AttentionMetadata):
        """(x, residual) -> (x, residual) of the next layer: the residual stream is x + residual (None at layer 0),
        so each residual add is fused into the norm that follows it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, attn_metadata)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, attn_metadata.lora), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = token_embedding(config.vocab_size, config.hidden_size, dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(config)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.output_proj: CpuLinear | None = None  # set by use_cpu_linear_layouts
        self.decoder_loop = None  # the layers as one native call, set by use_cpu_linear_layouts

    def op_plan(self) -> list[LayerPlan]:
        """Each layer's ops (layers/op_plan.py), from its modules: what the native decoder loop runs."""
        return [layer.ops() for layer in self.layers]

    def model_level_capabilities(self) -> set[Capability]:
        """What the model computes outside its layers."""
        return {Capability.TIED_EMBEDDINGS} if self.config.tie_word_embeddings else set()

    @property
    def capabilities(self) -> frozenset[Capability]:
        """What this model computes (layers/capabilities.py), read off its modules' op plan."""
        return op_plan.capabilities(self.op_plan(), self.model_level_capabilities())

    @property
    def output_weight(self) -> torch.Tensor:
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def use_cpu_linear_layouts(self) -> None:
        """After loading, on CPU: every projection (and the output matrix) becomes a CpuLinear."""
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj, attn.o_proj = (
                CpuLinear.from_linear(attn.qkv_proj),
                CpuLinear.from_linear(attn.o_proj),
            )
            mlp.gate_up_proj, mlp.down_proj = (
                CpuLinear.from_linear(mlp.gate_up_proj, swiglu=mlp.swiglu),
                CpuLinear.from_linear(mlp.down_proj),
            )
        self._use_output_layout()
        self.decoder_loop = self._native_decoder_loop()

    def _use_output_layout(self) -> None:
        """The output projection as a CpuLinear of float32 logits (no ties by rounding); tied embeddings: a transposed
        copy, the embedding table staying for lookups. One set already (a GGUF file's codes) is kept."""
        if self.output_proj is None:
            self.output_proj = CpuLinear(self.output_weight, float_output=True, policy=loading_policy())
        self.lm_head = None

    def _native_decoder_loop(self):
        """The layers as one native call (kernels/decoder_loop.cpp runs the op plan with the operators the Python
        layers call, without some twenty interpreter round trips a layer), or None where it does not run them: native
        kernels off or not built, a dtype they do not take, or an op the loop lacks (logged)."""
        dtype = self.embed_tokens.weight.dtype
        native = kernels.for_tensors(self.embed_tokens.weight, dtypes=kernels.FUSED_DTYPES)
        if native is None or not env.native_decoder_loop():
            return None
        plan = self.op_plan()
        tensors = [t for layer in plan for op in layer for t in op.tensors]
        if any(t.dtype != dtype or not t.is_contiguous() for t in tensors):
            return None
        # windowed or soft-capped attention has no 8-bit pool path: such steps go to the Python layers, which say so
        self._loop_takes_8bit_kv = not {Capability.SLIDING_WINDOW, Capability.SOFTCAP} & op_plan.capabilities(plan)
        # a loop built before the adapter slots were attached has none: a step with adapters then runs the Python layers
        self._loop_takes_lora = any(op.takes_adapters() for layer in plan for op in layer)
        return op_plan.native_loop(native, plan)

    def refresh_decoder_loop(self) -> None:
        """The native loop rebuilt from the plan as it is now (worker/lora_slots.py attached adapter slots to the
        projections, which the loop then runs too)."""
        if self.decoder_loop is not None:
            self.decoder_loop = self._native_decoder_loop()

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def rope_tables(
        self, positions: torch.Tensor, dtype: torch.dtype, attn_metadata: AttentionMetadata
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) of each RoPE table a layer may rotate with (Attention.rope_table indexes them)."""
        return [self.rotary(positions, dtype, attn_metadata.long_context)]

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Packed tokens [T] at positions [T] -> final hidden states [T, H] (normed)."""
        x = self.embed(input_ids)
        tables = self.rope_tables(positions, x.dtype, attn_metadata)
        lora = attn_metadata.lora
        native_off = self.decoder_loop is None or (lora and (not self._loop_takes_lora or lora.native is None))
        step = None if native_off else native_step(x, self.config.head_dim, kv_caches[0], attn_metadata)
        if step is not None:
            keys, values = [k for k, _ in kv_caches], [v for _, v in kv_caches]
            scales = [quantized_kv_scales(kv) for kv in kv_caches]  # an 8-bit pool's; none for a float one
            key_scales, value_scales = [k for k, _ in scales if k is not None], [v for _, v in scales if v is not None]
            if not key_scales or self._loop_takes_8bit_kv:
                rope = [t for table in tables for t in table]
                groups = lora.native if lora else None  # each projection's adapter deltas, added in the loop
                x, residual = self.decoder_loop.forward(x, rope, keys, values, step, key_scales, value_scales, groups)
                return self.norm(x, residual)[0]
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            cos, sin = tables[layer.self_attn.rope_table]
            x, residual = layer(x, residual, cos, sin, kv_cache, attn_metadata)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V]: on the CPU float32 from the GEMM's accumulator (bf16 logits tie: two
        tokens a bf16 step apart read the same), elsewhere in the model dtype."""
        if self.output_proj is not None:
            return self.output_proj(hidden)
        return F.linear(hidden, self.output_weight)

    # --- weight loading -------------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors (`model.layers.0.self_attn.q_proj.weight`, ...), fusing q/k/v and gate/up.

        Raises if a parameter of the model received nothing.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            target = self._map_name(name)
            if target is None:
                continue
            param_name, offset = target
            if param_name not in params:
                raise KeyError(f"checkpoint tensor {name} maps to unknown parameter {param_name}")
            param = params[param_name]
            with torch.no_grad():
                if offset is None:
                    if param.shape != tensor.shape:
                        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(param.shape)}")
                    param.copy_(tensor)
                    loaded.add(param_name)
                else:
                    part = param.narrow(0, offset, tensor.shape[0])
                    if part.shape != tensor.shape:
                        raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(part.shape)}")
                    part.copy_(tensor)
                    loaded.add(f"{param_name}[{offset}]")
        self._check_complete(params, loaded)

    def _fused_sizes(self) -> tuple[int, int, int]:
        c = self.config
        return c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim, c.intermediate_size

    def _map_name(self, name: str) -> tuple[str, int | None] | None:
        """HF checkpoint name -> (our parameter name, row offset into a fused parameter or None)."""
        if name.startswith("model."):
            name = name[len("model.") :]
        if "rotary_emb" in name or name.startswith("score."):  # a classifier's head: worker/pooling_model.py reads it
            return None
        if name == "lm_head.weight" and self.lm_head is None:
            return None  # tied: the embedding is the output matrix
        q, kv, inter = self._fused_sizes()
        fused = {
            ".self_attn.q_proj.": (".self_attn.qkv_proj.", 0),
            ".self_attn.k_proj.": (".self_attn.qkv_proj.", q),
            ".self_attn.v_proj.": (".self_attn.qkv_proj.", q + kv),
            ".mlp.gate_proj.": (".mlp.gate_up_proj.", 0),
            ".mlp.up_proj.": (".mlp.gate_up_proj.", inter),
        }
        for part, (replacement, offset) in fused.items():
            if part in name:
                return name.replace(part, replacement), offset
        return name, None  # Phi-3's qkv_proj / gate_up_proj too: fused in the checkpoint as here

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        q, kv, inter = self._fused_sizes()
        missing = []
        for name in params:
            if name in loaded:  # whole, from a fused checkpoint tensor
                continue
            if ".qkv_proj." in name:
                expected = [f"{name}[0]", f"{name}[{q}]", f"{name}[{q + kv}]"]
            elif ".gate_up_proj." in name:
                expected = [f"{name}[0]", f"{name}[{inter}]"]
            else:
                expected = [name]
            missing.extend(e for e in expected if e not in loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:5]}")


# --- the architectures this module runs (models/registry.py) ------------------------------------------------------


def _silu_only(cfg: dict) -> None:
    if cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")


def _llama_fields(cfg: dict) -> dict:
    _silu_only(cfg)
    return {}


def _mistral_fields(cfg: dict) -> dict:
    _silu_only(cfg)
    return {"sliding_window": cfg.get("sliding_window")}  # honoured: layers/windowed_attention.py


def _qwen2_fields(cfg: dict) -> dict:
    _silu_only(cfg)
    return {"attention_bias": True, **qwen_window_fields(cfg)}  # Qwen2: q/k/v always carry a bias (o_proj none)


def _qwen3_fields(cfg: dict) -> dict:
    _silu_only(cfg)
    return {"qk_norm": True, **qwen_window_fields(cfg)}


def _phi3_fields(cfg: dict) -> dict:
    """Phi-3 honours its sliding_window (transformers' mask does); one at or past the context length is no window."""
    _silu_only(cfg)
    window = cfg.get("sliding_window")
    if window is not None and window >= cfg.get("max_position_embeddings", 4096):
        window = None
    return {"sliding_window": window, "attention_bias": False}


_MODEL = "batchserve.models.llama:LlamaForCausalLM"
_EXACT_ROPE = "RoPE linear/llama3/YaRN exact; dynamic NTK exact while the prompt fits max_position_embeddings"
for _spec in (
    ArchitectureSpec("llama", ("LlamaForCausalLM",), ("llama",), _MODEL, _llama_fields,
                     f"exact (Llama 2/3.x, SmolLM2); {_EXACT_ROPE}; GGUF rope_freqs as llama.cpp applies them"),
    ArchitectureSpec("mistral", ("MistralForCausalLM",), (), _MODEL, _mistral_fields,
                     "exact, sliding window honoured"),
    ArchitectureSpec("qwen2", ("Qwen2ForCausalLM",), ("qwen2",), _MODEL, _qwen2_fields,
                     "exact (q/k/v biases; use_sliding_window on its layers)"),
    ArchitectureSpec("qwen3", ("Qwen3ForCausalLM",), ("qwen3",), _MODEL, _qwen3_fields,
                     "exact (q/k RMSNorm, explicit head_dim, use_sliding_window)"),
    ArchitectureSpec("phi3", ("Phi3ForCausalLM",), ("phi3",), _MODEL, _phi3_fields,
                     "exact (fused qkv/gate_up, partial rotary, LongRoPE past original_max_position_embeddings)"),
):  # fmt: skip
    register(_spec)
