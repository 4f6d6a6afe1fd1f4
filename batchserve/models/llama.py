"""One Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2) over packed tokens and a paged KV cache.

RMSNorm, RoPE (HF rotate_half convention, llama3 / linear scaling), GQA, SwiGLU. Q/K/V are one Linear and gate/up
are one Linear: the loader concatenates the checkpoint's separate weights into them (`load_weights`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from batchserve.config import ModelConfig
from batchserve.worker import kernels
from batchserve.worker.attention import AttentionMetadata, KVCache, paged_attention

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
    native = kernels.for_tensors(x)
    if native is not None and x.stride(2) == 1 and x.stride(1) == x.shape[2]:
        native.rope_(x, cos, sin)
        return x
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class CpuLinear(nn.Module):
    """A Linear laid out for this CPU's GEMMs, picked per call by the number of rows M (measured, see
    benchmarks/roofline.py): the native small-M kernel (weight packed in 32-column panels) for decode-sized M, oneDNN
    with a pre-packed weight for the wide projections (gate/up, lm_head) up to prefill-sized M, a plain [in, out]
    weight (x @ W) otherwise. Each layout is a copy of the weight: memory traded for speed."""

    SMALL_MIN_M = 2  # one row streams the weight fastest as x @ W
    SMALL_MAX_M = {False: 48, True: 64}  # up to where the native kernel wins: {narrow projection?: M}
    PACKED_MAX_M = 512  # from here on (prefill chunks) x @ W is as fast
    NARROW_OUT = 1024  # qkv, o and down: x @ W is as fast as oneDNN's packed kernel

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__()
        self.out_features = weight.shape[0]
        weight = weight.detach()
        if weight.dtype in (torch.bfloat16, torch.float16) and not kernels.has_matmul_units(weight.dtype):
            # Without bf16/fp16 matmul units torch's GEMM in them runs at ~1/4 of float32's. A product of two bf16
            # (or fp16) values is exact in float32, so a float32 GEMM on widened copies, its result rounded back, is
            # what a bf16 GEMM with float32 accumulation computes, in another summation order.
            weight = weight.float()
            bias = None if bias is None else bias.float()
        self.register_buffer("weight_t", weight.t().contiguous())
        self.register_buffer("bias", None if bias is None else bias.detach())
        narrow = self.out_features <= self.NARROW_OUT
        self.register_buffer("packed", None if narrow else _mkldnn_pack(weight))
        self.small_max_m = self.SMALL_MAX_M[narrow]
        native = kernels.for_tensors(weight)
        small = native is not None and native.small_gemm_available()
        self.register_buffer("small_packed", native.small_gemm_pack(weight) if small else None)

    @classmethod
    def from_linear(cls, linear: nn.Linear) -> CpuLinear:
        return cls(linear.weight, linear.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.weight_t.dtype:  # bf16/fp16 activations, float32 layouts (see __init__)
            return self._forward(x.to(self.weight_t.dtype)).to(x.dtype)
        return self._forward(x)

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        if m < self.SMALL_MIN_M:
            out = torch.matmul(x, self.weight_t)
        elif self.small_packed is not None and m <= self.small_max_m:
            out = kernels.load().small_gemm(x, self.small_packed, self.out_features)
        elif self.packed is not None and m < self.PACKED_MAX_M:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        else:
            out = torch.matmul(x, self.weight_t)
        return out if self.bias is None else out + self.bias


def _mkldnn_pack(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a float32 weight, or None where this torch build has no oneDNN linear."""
    if weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight, None)
    except (AttributeError, RuntimeError):
        return None


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: (norm(x + residual), x + residual), the sum being the next residual stream.
        The native kernel does either in one pass (the sum in place in `residual`)."""
        native = kernels.for_tensors(x)
        if native is not None and x.dim() == 2 and x.stride(1) == 1:
            out = native.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


class Attention(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
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

    def forward(self, x, cos, sin, kv_cache: KVCache, attn_metadata: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qk, v = self.qkv_proj(x).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads rotate together: one RoPE pass instead of two
        qk = apply_rope(qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = paged_attention(q, k, v, kv_cache, attn_metadata, scale=self.scale)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class MLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        native = kernels.for_tensors(gate_up)
        if native is not None and gate_up.stride(1) == 1:
            return self.down_proj(native.silu_and_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.self_attn = Attention(config, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.mlp = MLP(config, dtype)

    def forward(self, x, residual, cos, sin, kv_cache: KVCache, attn_metadata: AttentionMetadata):
        """(x, residual) -> (x, residual) of the next layer: the residual stream is x + residual (None at layer 0),
        so each residual add is fused into the norm that follows it."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, cos, sin, kv_cache, attn_metadata)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary = RotaryEmbedding(config)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.output_proj: CpuLinear | None = None  # set by use_cpu_linear_layouts

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
                CpuLinear.from_linear(mlp.gate_up_proj),
                CpuLinear.from_linear(mlp.down_proj),
            )
        # tied embeddings: the output projection is a transposed copy, the embedding table stays for lookups
        self.output_proj = CpuLinear(self.output_weight)
        self.lm_head = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        attn_metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """Packed tokens [T] at positions [T] -> final hidden states [T, H] (normed)."""
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions, x.dtype)
        residual = None
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos, sin, kv_cache, attn_metadata)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, H] -> logits [N, V] (in the model dtype)."""
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
        if "rotary_emb" in name:
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
        return name, None

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        q, kv, inter = self._fused_sizes()
        missing = []
        for name in params:
            if ".qkv_proj." in name:
                expected = [f"{name}[0]", f"{name}[{q}]", f"{name}[{q + kv}]"]
            elif ".gate_up_proj." in name:
                expected = [f"{name}[0]", f"{name}[{inter}]"]
            else:
                expected = [name]
            missing.extend(e for e in expected if e not in loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} tensor(s), e.g. {missing[:5]}")
