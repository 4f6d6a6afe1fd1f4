"""quantization gguf: a GGUF file's quantized matrices run as stored. Each decoder layer's projections become
QuantizedLinear layers over the file's own codes (layers/gguf_codes.py: repacked once, never re-quantized; q/k/v and
gate/up concatenated code for code), set in place before the float weights load so that their float copies are never
filled; the output projection runs from its (or, tied, the embedding's) codes. F32/F16/BF16 tensors (norms, the
embedding table for lookups) load as they do without quantization (docs/quantization.md)."""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import nn

from batchserve.config import ModelConfig
from batchserve.layers import gguf_codes
from batchserve.layers.linear import loading_policy
from batchserve.layers.quantization import QuantizedLinear

logger = logging.getLogger(__name__)

# our (sub-module, projection) of a decoder layer -> the GGUF tensors stacked into it, in row order
FUSED_PARTS = {
    ("self_attn", "qkv_proj"): ("attn_q", "attn_k", "attn_v"),
    ("self_attn", "o_proj"): ("attn_output",),
    ("mlp", "gate_up_proj"): ("ffn_gate", "ffn_up"),
    ("mlp", "down_proj"): ("ffn_down",),
}
# the same tensors fused in the file (Phi-3: attn_qkv; its ffn_up holds gate and up)
FUSED_IN_FILE = {"attn_q": "attn_qkv", "ffn_gate": "ffn_up"}
# HF checkpoint names of the projections these replace (not loaded from the float cache)
_PROJECTION_NAME = re.compile(r"\.(self_attn\.(q|k|v|o|qkv)_proj|mlp\.(gate|up|down|gate_up)_proj)\.(weight|bias)$")


def runs_from_codes(hf_name: str) -> bool:
    """Whether a checkpoint tensor is one of the projections use_stored_projections replaces."""
    return _PROJECTION_NAME.search(hf_name) is not None


class StoredTensors:
    """A GGUF file's tensors by name, repacked on demand."""

    def __init__(self, reader, config: ModelConfig, qk_heads: tuple[int, int] | None):
        self.tensors = {t.name: t for t in reader.tensors}
        self.config, self.qk_heads = config, qk_heads

    @classmethod
    def open(cls, path: Path, config: ModelConfig, qk_heads: tuple[int, int] | None) -> StoredTensors:
        """A reader of its own (not gguf_config's cached one), dropped once the model is loaded: neither the mapped
        file's pages nor the parsed header stay resident beside the codes."""
        import gguf

        return cls(gguf.GGUFReader(path), config, qk_heads)

    def codes(self, name: str) -> gguf_codes.StoredCodes:
        tensor = self.tensors[name]
        stored = gguf_codes.repack(np.asarray(tensor.data), tensor.tensor_type.name)
        rows = self._qk_rows(name, stored.out_features)
        return stored if rows is None else gguf_codes.permute_rows(stored, rows)

    def float_tensor(self, name: str) -> torch.Tensor:
        from batchserve.models.gguf_weights import dequantize

        values = torch.from_numpy(np.array(dequantize(self.tensors[name]), dtype=np.float32))
        rows = self._qk_rows(name, values.shape[0])
        return values if rows is None else values[torch.from_numpy(rows)]

    def _qk_rows(self, name: str, n: int) -> np.ndarray | None:
        """llama.cpp's q/k row permutation undone (models/gguf_weights.unpermute_qk on the row indices)."""
        from batchserve.models.gguf_weights import unpermute_qk

        kind = name.split(".")[2] if name.startswith("blk.") else ""
        if self.qk_heads is None or kind not in ("attn_q", "attn_k"):
            return None
        return unpermute_qk(np.arange(n), self.qk_heads[0 if kind == "attn_q" else 1])

    def type_of(self, name: str) -> str:
        return self.tensors[name].tensor_type.name

    def check_matrices(self) -> None:
        """Every tensor not in a float type runs as stored, or ConfigError naming the first that does not."""
        self.check_types([n for n in self.tensors if self.type_of(n) not in gguf_codes.FLOAT_TYPES])

    def check_types(self, names: list[str]) -> None:
        """Every named matrix runs as stored, or ConfigError naming the first that does not, before any is read."""
        for name in names:
            gguf_codes.check_type(self.type_of(name), name)

    def layer_parts(self, index: int, parts: tuple[str, ...]) -> list[str]:
        fused = FUSED_IN_FILE.get(parts[0])
        if (fused == "attn_qkv" and f"blk.{index}.attn_qkv.weight" in self.tensors) or (
            fused == "ffn_up" and self.config.architecture == "phi3"
        ):
            return [f"blk.{index}.{fused}"]
        return [f"blk.{index}.{part}" for part in parts]


def _projection(stored: StoredTensors, bases: list[str], float_output: bool = False) -> QuantizedLinear:
    codes = gguf_codes.concatenate([stored.codes(f"{base}.weight") for base in bases])
    biases = [f"{base}.bias" for base in bases if f"{base}.bias" in stored.tensors]
    bias = torch.cat([stored.float_tensor(b) for b in biases]) if biases else None
    return QuantizedLinear.from_codes(
        codes.codes,
        codes.scales,
        codes.scheme,
        bias=bias,
        mins=codes.mins,
        float_output=float_output,
        policy=loading_policy(),
    )


def use_stored_projections(
    model: nn.Module, stored: StoredTensors, weights: Iterator[tuple[str, torch.Tensor]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every decoder layer's projections from the file's codes, in place (their float parameters, allocated but never
    filled, go with them); -> the float weights still to load (the projections' names dropped)."""
    plan = []
    for index, layer in enumerate(model.layers):
        for (owner, attribute), parts in FUSED_PARTS.items():
            if isinstance(getattr(getattr(layer, owner, None), attribute, None), nn.Linear):
                plan.append((getattr(layer, owner), attribute, stored.layer_parts(index, parts)))
    stored.check_types([f"{base}.weight" for *_, bases in plan for base in bases])
    for module, attribute, bases in plan:
        setattr(module, attribute, _projection(stored, bases))
    logger.info("quantization gguf: %d projections run from the file's codes", len(plan))
    return ((name, tensor) for name, tensor in weights if not runs_from_codes(name))


def use_stored_output(model: nn.Module, stored: StoredTensors) -> bool:
    """The output projection (the logits, float32) from the codes of output.weight, or of token_embd.weight when the
    embedding is tied, set before the float weights load (an untied float output matrix is then never allocated or
    filled: its float copy and CPU layouts were the largest part of the peak memory); a float tensor stays the float
    CpuLinear. -> whether output.weight is one whose float copy must not be read."""
    name = "output.weight" if "output.weight" in stored.tensors else "token_embd.weight"
    if stored.type_of(name) in gguf_codes.FLOAT_TYPES:
        return False
    stored.check_types([name])
    model.output_proj = _projection(stored, [name.removesuffix(".weight")], float_output=True)
    model.lm_head = None
    return name == "output.weight"


def first_matrix_not_as_stored(types: dict[str, str]) -> str | None:
    """The first tensor of a GGUF file whose type the as-stored kernels do not take, as "name (type)"; None: every
    one runs as stored (float tensors load as they are). `types`: the file's {tensor name: type name}."""
    for name, kind in types.items():
        if kind not in gguf_codes.FLOAT_TYPES and kind not in gguf_codes.TYPES_AS_STORED:
            return f"{name} ({kind})"
    return None
