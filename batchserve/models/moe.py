"""Mixture-of-experts decoders: Mixtral and Qwen3-MoE.

Each is the Llama-family decoder of models/llama.py (attention, norms, RoPE, weight loading and the output matrix are
that module's; Qwen3-MoE's q/k RMSNorm is Qwen3's) whose MLPs are sparse MoE blocks (layers/moe.py): a router picks
each token's top-k experts. Qwen3-MoE keeps a dense MLP of intermediate_size on the layers `mlp_only_layers` names and
on those `decoder_sparse_step` skips. The experts load from a checkpoint's per-expert tensors (Mixtral's
`block_sparse_moe.experts.N.w1/w2/w3`, Qwen3-MoE's `mlp.experts.N.gate_proj/up_proj/down_proj`) into stacked
weights, or from transformers 5's stacked `mlp.experts.gate_up_proj` / `mlp.experts.down_proj`. An MoE block is one
op of the layer's plan (layers/op_plan.py MOE_MLP), which the native decoder loop runs as the Python block does. The
architectures register themselves in models/registry.py at the end of this module.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from batchserve.config import ModelConfig
from batchserve.layers.linear import CpuLinear
from batchserve.layers.moe import SparseMoE
from batchserve.models.hf_config import qwen_window_fields
from batchserve.models.llama import LlamaForCausalLM, _silu_only
from batchserve.models.registry import ArchitectureSpec, register

# a per-expert checkpoint tensor: layers.<i>.mlp.experts.<e>.<projection>.weight (after Mixtral's names are mapped)
_EXPERT_TENSOR = re.compile(r"layers\.(\d+)\.mlp\.experts\.(\d+)\.(\w+)\.weight")
# transformers 5 saves the experts stacked: layers.<i>.mlp.experts.gate_up_proj / down_proj
_STACKED_TENSOR = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
# projection -> (stacked parameter, which half of gate_up: 0 gate, 1 up; None: down, whole)
_PROJECTIONS = {
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1), "down_proj": ("down_proj", None),
    "w1": ("gate_up_proj", 0), "w3": ("gate_up_proj", 1), "w2": ("down_proj", None),  # Mixtral
}  # fmt: skip


def is_sparse_layer(config: ModelConfig, layer: int) -> bool:
    return config.num_experts > 0 and layer not in config.dense_mlp_layers


class MoEForCausalLM(LlamaForCausalLM):
    """The Llama-family decoder with sparse MoE MLPs where the config puts them."""

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__(config, dtype)
        for index, layer in enumerate(self.layers):
            if is_sparse_layer(config, index):
                layer.mlp = SparseMoE(
                    config.hidden_size,
                    config.moe_intermediate_size or config.intermediate_size,
                    config.num_experts,
                    config.num_experts_per_tok,
                    config.norm_topk_prob,
                    dtype,
                )

    def use_cpu_linear_layouts(self) -> None:
        """As LlamaForCausalLM's, with each expert laid out by its MoE block."""
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj, attn.o_proj = CpuLinear.from_linear(attn.qkv_proj), CpuLinear.from_linear(attn.o_proj)
            if isinstance(mlp, SparseMoE):
                mlp.use_cpu_linear_layouts()
            else:
                mlp.gate_up_proj = CpuLinear.from_linear(mlp.gate_up_proj, swiglu=mlp.swiglu)
                mlp.down_proj = CpuLinear.from_linear(mlp.down_proj)
        self._use_output_layout()
        self.decoder_loop = self._native_decoder_loop()

    # --- weight loading -------------------------------------------------------------------------------------------

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """LlamaForCausalLM's loading, the expert tensors taken out of the stream and copied into their slices here.
        Raises if an expert's projection received nothing."""
        self._expert_parts: set[tuple[str, int, int | None]] = set()
        super().load_weights(self._load_experts(weights))

    def _map_name(self, name: str) -> tuple[str, int | None] | None:
        return super()._map_name(name.replace(".block_sparse_moe.", ".mlp."))  # Mixtral's name of the MoE block

    def _load_experts(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        """Copy each expert tensor into its stacked parameter; yield every other tensor."""
        for name, tensor in weights:
            short = name.removeprefix("model.").replace(".block_sparse_moe.", ".mlp.")
            match = _EXPERT_TENSOR.fullmatch(short)
            if match is not None and match.group(3) in _PROJECTIONS:
                layer, expert, projection = int(match.group(1)), int(match.group(2)), match.group(3)
                self._copy_expert(layer, expert, *_PROJECTIONS[projection], tensor, name)
                continue
            match = _STACKED_TENSOR.fullmatch(short)
            if match is not None:
                for expert in range(tensor.shape[0]):
                    for half in (0, 1) if match.group(2) == "gate_up_proj" else (None,):
                        part = tensor[expert] if half is None else tensor[expert].chunk(2)[half]
                        self._copy_expert(int(match.group(1)), expert, match.group(2), half, part, name)
                continue
            yield name, tensor

    def _copy_expert(self, layer: int, expert: int, param: str, half: int | None, tensor: torch.Tensor, name: str):
        mlp = self.layers[layer].mlp if layer < len(self.layers) else None
        if not isinstance(mlp, SparseMoE) or expert >= mlp.experts.num_experts:
            raise KeyError(f"checkpoint tensor {name} names an expert this model does not have")
        target = getattr(mlp.experts, param)[expert]
        if half is not None:
            target = target.chunk(2)[half]
        if target.shape != tensor.shape:
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != {tuple(target.shape)}")
        with torch.no_grad():
            target.copy_(tensor)
        self._expert_parts.add((f"layers.{layer}.mlp.experts.{param}", expert, half))

    def _check_complete(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        """Llama's check for every other parameter; each expert's gate, up and down here."""
        stacked = {name for name in params if ".mlp.experts." in name}
        super()._check_complete({k: v for k, v in params.items() if k not in stacked}, loaded)
        missing = [
            f"{name}[{expert}]" + ("" if half is None else (".gate", ".up")[half])
            for name in sorted(stacked)
            for expert in range(params[name].shape[0])
            for half in ((None,) if name.endswith("down_proj") else (0, 1))
            if (name, expert, half) not in self._expert_parts
        ]
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} expert tensor(s), e.g. {missing[:5]}")


# --- the architectures this module runs (models/registry.py) ------------------------------------------------------


def _num_experts(cfg: dict) -> int:
    """Qwen3-MoE's config.json says num_experts; Mixtral's (and transformers 5's Qwen3-MoE) num_local_experts."""
    return int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)


def _mixtral_fields(cfg: dict) -> dict:
    _silu_only(cfg)
    return {
        "sliding_window": cfg.get("sliding_window"),  # honoured, as Mistral's (layers/windowed_attention.py)
        "num_experts": _num_experts(cfg),
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 2)),
        "norm_topk_prob": True,
    }


def _qwen3_moe_fields(cfg: dict) -> dict:
    """Qwen3's attention (q/k RMSNorm); a dense MLP on the layers mlp_only_layers names and on those
    decoder_sparse_step skips (layer i is sparse where (i + 1) % step == 0), as transformers builds them."""
    _silu_only(cfg)
    num_experts = _num_experts(cfg)
    step = int(cfg.get("decoder_sparse_step") or 1)
    mlp_only = set(cfg.get("mlp_only_layers") or ())
    dense = [i for i in range(cfg["num_hidden_layers"]) if i in mlp_only or num_experts == 0 or (i + 1) % step]
    return {
        "qk_norm": True,
        "num_experts": num_experts,
        "num_experts_per_tok": int(cfg.get("num_experts_per_tok", 8)),
        "moe_intermediate_size": int(cfg["moe_intermediate_size"]),
        "norm_topk_prob": bool(cfg.get("norm_topk_prob", False)),
        "dense_mlp_layers": dense,
        **qwen_window_fields(cfg),
    }


_MODEL = "batchserve.models.moe:MoEForCausalLM"
for _spec in (
    ArchitectureSpec("mixtral", ("MixtralForCausalLM",), (), _MODEL, _mixtral_fields,
                     "exact (top-k renormalised; experts grouped per step), sliding window honoured"),
    ArchitectureSpec("qwen3_moe", ("Qwen3MoeForCausalLM",), ("qwen3moe",), _MODEL, _qwen3_moe_fields,
                     "exact (q/k RMSNorm, norm_topk_prob, dense mlp_only_layers / decoder_sparse_step; experts grouped "
                     "per step; use_sliding_window)"),
):  # fmt: skip
    register(_spec)
