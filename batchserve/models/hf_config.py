"""A Hugging Face config.json (+ generation_config.json) -> ModelConfig: the fields every decoder has, read here once;
what one family sets beyond them comes from its registry spec's `config_fields` (models/registry.py)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from batchserve.config import ModelConfig
from batchserve.models import registry
from batchserve.models.registry import ModelLoadError

logger = logging.getLogger(__name__)

# RoPE types and the names older configs give them
ROPE_TYPE_ALIASES = {"su": "longrope", "dynamic_ntk": "dynamic"}


def read_hf_config(path: Path) -> ModelConfig:
    """The ModelConfig of a Hugging Face model folder; an architecture no spec claims is refused with the list."""
    cfg = json.loads((path / "config.json").read_text())
    spec = registry.lookup(model_type=cfg.get("model_type"), hf_class_names=cfg.get("architectures") or ())
    if cfg.get("mlp_bias"):
        raise ModelLoadError("mlp_bias=True is not supported")
    config = common_fields(cfg, path / "generation_config.json")
    config.architecture = spec.model_type
    return dataclasses.replace(config, **spec.config_fields(cfg)) if spec.config_fields else config


def common_fields(cfg: dict[str, Any], generation_config: Path | None = None) -> ModelConfig:
    """The fields every decoder's config.json spells the same way (transformers 4 and 5)."""
    eos = as_id_list(cfg.get("eos_token_id"))
    if generation_config is not None and generation_config.is_file():
        eos = as_id_list(json.loads(generation_config.read_text()).get("eos_token_id")) + eos
    num_heads = cfg["num_attention_heads"]
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
    rope_theta, rope_scaling = hf_rope(cfg)
    partial = float(cfg.get("partial_rotary_factor") or (cfg.get("rope_parameters") or {}).get("partial_rotary_factor")
                    or 1.0)  # fmt: skip
    return ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=head_dim,
        max_position_embeddings=served_context(cfg.get("max_position_embeddings", 2048), rope_scaling),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        rotary_dim=int(head_dim * partial) if partial != 1.0 else None,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos)),
        architecture=cfg.get("model_type", "llama"),
        hidden_act=cfg.get("hidden_act", cfg.get("hidden_activation", "silu")),
    )


def hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and the scaling dict (None for plain RoPE), from transformers<5 (rope_theta + rope_scaling) or >=5
    (rope_parameters). The dict names its type as `rope_type` and holds what layers/rotary.py reads: as in
    transformers' standardize_rope_params, a top-level original_max_position_embeddings (Phi-3's spelling) wins."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or {k: v for k, v in params.items() if k not in ("rope_theta",)}
    scaling = {k: v for k, v in scaling.items() if k != "partial_rotary_factor"}
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    rope_type = ROPE_TYPE_ALIASES.get(rope_type, rope_type)
    if not scaling or rope_type == "default":
        return theta, None
    scaling = {k: v for k, v in scaling.items() if k != "type"} | {"rope_type": rope_type}
    if rope_type in ("llama3", "yarn", "longrope"):
        original = cfg.get("original_max_position_embeddings") or scaling.get("original_max_position_embeddings")
        scaling["original_max_position_embeddings"] = original or cfg.get("max_position_embeddings", 2048)
    if rope_type == "dynamic":  # transformers' dynamic NTK grows the base past max_position_embeddings
        scaling.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 2048))
    return theta, scaling


def served_context(max_position_embeddings: int, rope_scaling: dict[str, Any] | None) -> int:
    """The context a model serves: YaRN and dynamic NTK stretch the original one by their factor (vLLM's rule), so a
    request may go past config.json's max_position_embeddings there; other models serve that length."""
    scaling = rope_scaling or {}
    if scaling.get("rope_type") in ("yarn", "dynamic") and scaling.get("factor"):
        stretched = int(scaling["original_max_position_embeddings"] * scaling["factor"])
        return max(max_position_embeddings, stretched)
    return max_position_embeddings


def as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def qwen_window_fields(cfg: dict[str, Any]) -> dict[str, Any]:
    """Qwen2/Qwen3(-MoE): a window only with use_sliding_window (off in released checkpoints), on the layers
    transformers gives one: layer_types' sliding_attention entries, else those from max_window_layers on. Every layer
    windowed: ModelConfig.sliding_window (blocks that leave it return to the pool); some: extra["windowed_layers"]."""
    window = cfg.get("sliding_window") if cfg.get("use_sliding_window") else None
    if not window:
        return {}
    types, first = cfg.get("layer_types"), cfg.get("max_window_layers", 28)
    layers = range(cfg["num_hidden_layers"])
    windowed = [i for i in layers if (types[i] == "sliding_attention" if types else i >= first)]
    if len(windowed) == len(layers):
        return {"sliding_window": window}
    return {"extra": {"windowed_layers": windowed, "layer_window": window}} if windowed else {}
