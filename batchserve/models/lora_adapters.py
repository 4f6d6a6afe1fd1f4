"""A PEFT LoRA adapter folder (adapter_config.json + adapter_model.safetensors), or llama.cpp's GGUF LoRA file
(models/gguf_lora.py), read and checked against the base model: each targeted projection's A [r, in] and B [out, r],
and its scale (alpha / r, or alpha / sqrt(r) with rsLoRA).

Everything wrong with a folder is a LoRALoadError naming the file, the module and the shapes; nothing of it is kept.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from batchserve.config import ConfigError, ModelConfig
from batchserve.models.gguf_lora import is_gguf_lora, read_gguf_lora

# the seven projections an adapter may target, as PEFT names them
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_KEY = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


class LoRALoadError(ConfigError):
    """An adapter that cannot be served on this base model (an HTTP 400, a refused start)."""


@dataclass
class LoRAAdapter:
    """One adapter's weights in host memory: (layer, target) -> (A [r, in], B [out, r]), all in `dtype`."""

    name: str
    lora_id: int
    path: str
    rank: int
    scale: float
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # (layer, projection) -> the weights in its slot layout (layers/lora.py LoRASlots.rows_of), made once, when read
    slot_rows: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor] | None] = field(default_factory=dict)

    @property
    def targets(self) -> set[str]:
        return {target for _, target in self.weights}

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """Each target projection's base weight shape [out, in]."""
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    h, inter = config.hidden_size, config.intermediate_size
    return {
        "q_proj": (q, h), "k_proj": (kv, h), "v_proj": (kv, h), "o_proj": (h, q),
        "gate_proj": (inter, h), "up_proj": (inter, h), "down_proj": (h, inter),
    }  # fmt: skip


def read_adapter_config(folder: Path) -> dict:
    path = folder / "adapter_config.json"
    try:
        cfg = json.loads(path.read_text())
    except FileNotFoundError:
        raise LoRALoadError(f"{folder}: no adapter_config.json (a PEFT LoRA folder holds it)") from None
    except (OSError, ValueError) as exc:
        raise LoRALoadError(f"{path}: cannot be read as JSON: {exc}") from None
    if not isinstance(cfg, dict):
        raise LoRALoadError(f"{path}: must hold a JSON object")
    peft_type = str(cfg.get("peft_type", "LORA")).upper()
    if peft_type != "LORA":
        raise LoRALoadError(f"{path}: peft_type {peft_type!r} is not served (LORA only)")
    unsupported = {
        "use_dora": bool(cfg.get("use_dora")),
        "bias": cfg.get("bias", "none") not in (None, "none"),
        "modules_to_save": bool(cfg.get("modules_to_save")),
        "rank_pattern": bool(cfg.get("rank_pattern")),
        "alpha_pattern": bool(cfg.get("alpha_pattern")),
        "fan_in_fan_out": bool(cfg.get("fan_in_fan_out")),
    }
    refused = [name for name, used in unsupported.items() if used]
    if refused:
        raise LoRALoadError(f"{path}: {', '.join(refused)} not served (plain LoRA / rsLoRA adapters only)")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), (int, float)) or cfg[key] <= 0:
            raise LoRALoadError(f"{path}: {key} must be a positive number, got {cfg.get(key)!r}")
    return cfg


def load_peft_adapter(
    folder: str | Path, name: str, lora_id: int, config: ModelConfig, max_rank: int, dtype: torch.dtype
) -> LoRAAdapter:
    """The adapter in `folder` (a PEFT folder, or llama.cpp's GGUF LoRA file: models/gguf_lora.py), checked against
    the base model's shapes and `max_rank`."""
    folder = Path(folder)
    if is_gguf_lora(folder):
        rank, scale, tensors = read_gguf_lora(folder, config, LoRALoadError)
    elif folder.is_dir():
        rank, scale, tensors = _read_peft_folder(folder)
    else:
        raise LoRALoadError(f"LoRA adapter {name!r}: {folder} is not a folder or a .gguf LoRA file")
    if rank > max_rank:
        raise LoRALoadError(f"LoRA adapter {name!r}: rank {rank} is over max_lora_rank {max_rank}")
    adapter = LoRAAdapter(name, lora_id, str(folder), rank, float(scale))
    shapes = target_shapes(config)
    parts: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise LoRALoadError(f"LoRA adapter {name!r}: tensor {key} is not a LoRA A/B of a decoder projection")
        layer, target, which = int(match.group(1)), match.group(2), match.group(3)
        if target not in shapes:
            raise LoRALoadError(f"LoRA adapter {name!r}: {key} targets {target}, not one of {', '.join(TARGETS)}")
        if layer >= config.num_layers:
            raise LoRALoadError(f"LoRA adapter {name!r}: {key} is for layer {layer}; the base has {config.num_layers}")
        parts.setdefault((layer, target), {})[which] = tensor
    for (layer, target), pair in sorted(parts.items()):
        module = f"layers.{layer}.{target}"
        if set(pair) != {"A", "B"}:
            raise LoRALoadError(f"LoRA adapter {name!r}: {module} has lora_{''.join(pair)} only")
        out_features, in_features = shapes[target]
        a, b = pair["A"], pair["B"]
        if a.dim() != 2 or b.dim() != 2 or a.shape != (rank, in_features) or b.shape != (out_features, rank):
            raise LoRALoadError(
                f"LoRA adapter {name!r}: {module} has A {tuple(a.shape)} and B {tuple(b.shape)}; the base's "
                f"{target} weight is {tuple(shapes[target])}, so rank {rank} needs A {(rank, in_features)} and "
                f"B {(out_features, rank)}"
            )
        adapter.weights[(layer, target)] = (a.to(dtype).contiguous(), b.to(dtype).contiguous())
    if not adapter.weights:
        raise LoRALoadError(f"LoRA adapter {name!r}: {folder} holds no LoRA weights")
    return adapter


def _read_peft_folder(folder: Path) -> tuple[int, float, dict[str, torch.Tensor]]:
    cfg = read_adapter_config(folder)
    rank = int(cfg["r"])
    return rank, cfg["lora_alpha"] / (math.sqrt(rank) if cfg.get("use_rslora") else rank), _read_tensors(folder)


def _read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = folder / "adapter_model.safetensors"
    if not path.exists():
        raise LoRALoadError(f"{folder}: no adapter_model.safetensors (only safetensors adapters are read)")
    try:
        return load_file(str(path))
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise LoRALoadError(f"{path}: not a readable safetensors file ({exc})") from None
