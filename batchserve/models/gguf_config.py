"""A GGUF file's metadata -> ModelConfig (llama.cpp's keys, `<arch>.<key>`), the architecture claimed through
models/registry.py, and the reverse for the conversion folder: a ModelConfig as the config.json transformers reads.

llama.cpp writes Llama 3.1+'s llama3 RoPE scaling as a tensor, rope_freqs.weight (one divisor per frequency), not as
metadata: it becomes rope_type "freq_factors" (layers/rotary.py divides the frequencies by it, as llama.cpp does), and
the config.json written for other tools gets the llama3 parameters that reproduce it."""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from batchserve.config import ModelConfig
from batchserve.layers.rotary import _llama3_inv_freq
from batchserve.models import registry
from batchserve.models.gemma import FULL, SLIDING
from batchserve.models.hf_config import as_id_list, served_context
from batchserve.models.registry import ModelLoadError

logger = logging.getLogger(__name__)

_TOKEN_FIELDS = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
# what a GGUF architecture sets beyond the common keys
_ARCH_FIELDS: dict[str, dict[str, Any]] = {"qwen2": {"attention_bias": True}, "qwen3": {"qk_norm": True},
                                           "gemma2": {"hidden_act": "gelu_pytorch_tanh"},
                                           "gemma3": {"hidden_act": "gelu_pytorch_tanh"}, "qwen3moe": {"qk_norm": True}}  # fmt: skip
# llama.cpp's Gemma: which layers are windowed is not in the file (every 2nd / 6th global), nor the local RoPE base of
# Gemma 3 in files converted before `rope.freq_base_swa` existed, nor query_pre_attn_scalar: llama.cpp derives it from
# the model size (the 27B models: hidden / heads; the others: head_dim), the 27B models known by their layer count.
_GEMMA_GLOBAL_EVERY = {"gemma2": 2, "gemma3": 6}
_GEMMA2_WINDOW = 4096  # llama.cpp's when a Gemma 2 file names none
_GEMMA_27B_LAYERS = {"gemma2": 46, "gemma3": 62}
ROPE_FREQS = "rope_freqs.weight"


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: Path, mtime_ns: int):
    """Parsing a GGUF header takes seconds (its token list), so config and weights loading share one parse."""
    import gguf

    return gguf.GGUFReader(path)


def gguf_reader(path: Path):
    return _gguf_reader(path.resolve(), path.stat().st_mtime_ns)


def gguf_fields(reader) -> dict[str, Any]:
    return {k: f.contents() for k, f in reader.fields.items() if k not in _TOKEN_FIELDS}


def read_gguf_config(path: Path) -> ModelConfig:
    reader = gguf_reader(path)
    meta = gguf_fields(reader)
    arch = meta["general.architecture"]
    tensors = {t.name: t for t in reader.tensors}

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    # llama.cpp writes Mixtral as `llama` with experts
    spec = registry.lookup(model_type="mixtral" if arch == "llama" and get("expert_count") else None, gguf_name=arch)

    hidden, num_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length") or get("rope.dimension_count") or hidden // num_heads)
    rope_dims = int(get("rope.dimension_count") or head_dim)
    eos = as_id_list(meta.get("tokenizer.ggml.eos_token_id")) + as_id_list(meta.get("tokenizer.ggml.eot_token_id"))
    vocab_size = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    rope_scaling = (
        _longrope_scaling(get, tensors) if arch == "phi3" else _gguf_rope_scaling(get, tensors.get(ROPE_FREQS))
    )
    window = get("attention.sliding_window")  # Phi-3-mini-4k's; one at or past the context is no window
    config = ModelConfig(
        vocab_size=int(vocab_size),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length") or get("expert_feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=num_heads,
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=head_dim,
        max_position_embeddings=served_context(int(get("context_length", 2048)), rope_scaling),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        rotary_dim=rope_dims if rope_dims != head_dim else None,
        tie_word_embeddings="output.weight" not in tensors,
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=list(dict.fromkeys(eos)),
        architecture=spec.model_type,
        sliding_window=int(window) if window and int(window) < int(get("context_length", 2048)) else None,
        **_ARCH_FIELDS.get(arch, {}),
        **_moe_fields(get),
    )
    if arch in _GEMMA_GLOBAL_EVERY:  # the Gemma settings as models/gemma.py reads them from a config.json
        # the window is per layer (ModelConfig.extra), not Mistral's one for every layer
        fields = {"sliding_window": None, **spec.config_fields(_gemma_hf_config(get, arch, config))}
        config = dataclasses.replace(config, **fields)
    return config


def _moe_fields(get) -> dict[str, Any]:
    """Experts: every layer sparse (llama.cpp's Mixtral and Qwen3-MoE have no dense layers); the top-k weights
    renormalised unless the file says otherwise (llama.cpp's Mixtral and Qwen3-MoE always renormalise)."""
    experts = int(get("expert_count") or 0)
    if not experts:
        return {}
    expert_ff = get("expert_feed_forward_length")
    return {"num_experts": experts, "num_experts_per_tok": int(get("expert_used_count")),
            "moe_intermediate_size": int(expert_ff) if expert_ff else None,
            "norm_topk_prob": bool(get("expert_weights_norm", True))}  # fmt: skip


def _gemma_hf_config(get, arch: str, config: ModelConfig) -> dict[str, Any]:
    """What a Gemma 2 / Gemma 3 GGUF says, as the config.json keys models/gemma.config_fields reads."""
    scale = get("attention.scale")
    if scale:
        query_pre_attn_scalar = 1.0 / float(scale) ** 2
    elif config.num_layers == _GEMMA_27B_LAYERS[arch]:
        query_pre_attn_scalar = config.hidden_size / config.num_heads
    else:
        query_pre_attn_scalar = config.head_dim
    window = _gemma_window(get, arch)
    hf = {
        "model_type": "gemma2" if arch == "gemma2" else "gemma3_text", "num_hidden_layers": config.num_layers,
        "hidden_size": config.hidden_size, "num_attention_heads": config.num_heads, "head_dim": config.head_dim,
        "sliding_window": window, "query_pre_attn_scalar": query_pre_attn_scalar,
        "layer_types": _gemma_layer_types(get, arch, config.num_layers, bool(window)),
        "attn_logit_softcapping": get("attn_logit_softcapping"), "final_logit_softcapping": get("final_logit_softcapping"),
        "rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tie_word_embeddings,
    }  # fmt: skip
    if arch == "gemma3":
        hf["rope_local_base_freq"] = float(get("rope.freq_base_swa") or 10000.0)
    return hf


def _gemma_window(get, arch: str) -> int | None:
    """The file's window; llama.cpp gives Gemma 2 one of 4096 tokens when it names none."""
    return get("attention.sliding_window", _GEMMA2_WINDOW if arch == "gemma2" else None) or None


def _gemma_layer_types(get, arch: str, num_layers: int, windowed: bool) -> list[str]:
    """llama.cpp's rule (load_swa_pattern): a per-layer array if the file has one; else a period n whose last layer is
    global (n 0: every layer windowed), 2 for Gemma 2 and 6 for Gemma 3 unless the file says otherwise. A Gemma 3
    file without a window has none."""
    if not windowed:
        return [FULL] * num_layers
    pattern = get("attention.sliding_window_pattern", _GEMMA_GLOBAL_EVERY[arch])
    if isinstance(pattern, (list, tuple)):
        return [SLIDING if is_windowed else FULL for is_windowed in pattern][:num_layers]
    n = int(pattern)
    return [SLIDING if n == 0 or i % n < n - 1 else FULL for i in range(num_layers)]


def _gguf_rope_scaling(get, rope_freqs) -> dict[str, Any] | None:
    kind = get("rope.scaling.type")
    if rope_freqs is not None:
        if kind not in (None, "none"):
            raise ModelLoadError(f"GGUF holds both rope_freqs and rope scaling {kind!r}: not a layout llama.cpp writes")
        factors = np.asarray(rope_freqs.data, dtype=np.float32).reshape(-1)
        return None if np.all(factors == 1.0) else {"rope_type": "freq_factors", "factors": factors.tolist()}
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    if kind == "yarn":
        original = get("rope.scaling.original_context_length") or get("context_length")
        return {"rope_type": "yarn", "factor": float(get("rope.scaling.factor")),
                "original_max_position_embeddings": int(original)}  # fmt: skip
    raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported (linear, yarn, rope_freqs)")


def _longrope_scaling(get, tensors) -> dict[str, Any] | None:
    """llama.cpp's Phi-3 layout: the short / long factors as tensors rope_factors_short / rope_factors_long, the
    original context and attention factor as metadata."""
    long, short = tensors.get("rope_factors_long.weight"), tensors.get("rope_factors_short.weight")
    if long is None or short is None:
        return None
    scaling = {"rope_type": "longrope", "long_factor": np.asarray(long.data, dtype=np.float32).reshape(-1).tolist(),
               "short_factor": np.asarray(short.data, dtype=np.float32).reshape(-1).tolist(),
               "original_max_position_embeddings": int(get("rope.scaling.original_context_length"))}  # fmt: skip
    if get("rope.scaling.attn_factor") is not None:
        scaling["attention_factor"] = float(get("rope.scaling.attn_factor"))
    return scaling


# --- a ModelConfig as a Hugging Face config.json ------------------------------------------------------------------


def hf_config_json(config: ModelConfig) -> dict[str, Any]:
    """A ModelConfig as a Hugging Face config.json that transformers' AutoConfig (and read_hf_config) read back."""
    spec = registry.lookup(model_type=config.architecture)
    eos = config.eos_token_ids
    hf = {
        "architectures": list(spec.hf_class_names[:1]), "model_type": config.architecture,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta,
        "rope_scaling": _hf_rope_scaling(config), "tie_word_embeddings": config.tie_word_embeddings,
        "hidden_act": config.hidden_act, "torch_dtype": "float32",
        "bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
        "pad_token_id": None,  # not a class default (Phi-3's 32000) that may lie outside this vocabulary
    }  # fmt: skip
    if config.architecture in ("llama", "qwen3"):
        hf["attention_bias"] = config.attention_bias
    if config.rotary_dim is not None:
        hf["partial_rotary_factor"] = config.rotary_dim / config.head_dim
    if config.sliding_window is not None:
        hf["sliding_window"] = config.sliding_window
    if config.architecture in ("gemma2", "gemma3_text"):
        hf.update(_gemma_config_json(config))
    if config.num_experts:
        hf.update(num_local_experts=config.num_experts, num_experts=config.num_experts,
                  num_experts_per_tok=config.num_experts_per_tok, norm_topk_prob=config.norm_topk_prob,
                  mlp_only_layers=list(config.dense_mlp_layers))  # fmt: skip
        if config.moe_intermediate_size is not None:
            hf["moe_intermediate_size"] = config.moe_intermediate_size
    return hf


def _int_if_whole(value: float) -> int | float:
    """transformers' Gemma configs type query_pre_attn_scalar as int and refuse 16.0."""
    return int(value) if float(value).is_integer() else value


def _gemma_config_json(config: ModelConfig) -> dict[str, Any]:
    """The Gemma settings (ModelConfig.extra, models/gemma.py) in config.json's spelling."""
    gemma = config.extra
    hf = {"hidden_activation": config.hidden_act, "layer_types": list(gemma["layer_types"]),
          "sliding_window": gemma["sliding_window"], "query_pre_attn_scalar": _int_if_whole(gemma["query_pre_attn_scalar"]),
          "final_logit_softcapping": gemma["final_softcap"]}  # fmt: skip
    if gemma["version"] == 2:
        hf["attn_logit_softcapping"] = gemma["attn_softcap"]
    else:
        hf["rope_local_base_freq"] = gemma["local_rope_theta"]
    return hf


def _hf_rope_scaling(config: ModelConfig) -> dict[str, Any] | None:
    scaling = config.rope_scaling
    if not scaling or scaling.get("rope_type") != "freq_factors":
        return scaling
    dim = config.rotary_dim or config.head_dim
    fitted = llama3_scaling_from_factors(scaling["factors"], config.rope_theta, dim)
    if fitted is None:
        logger.warning("config.json: the GGUF's rope_freqs are not llama3 scaling; written without RoPE scaling")
    return fitted


def llama3_scaling_from_factors(factors: list[float], theta: float, dim: int, original: int = 8192) -> dict | None:
    """The llama3 rope_scaling whose frequencies are theta's divided by `factors` (llama.cpp's rope_freqs), or None.
    Only original / low_freq_factor and original / high_freq_factor are determined by them; `original` fixes both."""
    f = torch.tensor(factors, dtype=torch.float64)
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    factor = float(f.max())
    medium = (f > 1.0 + 1e-6) & (f < factor - 1e-6)
    if factor <= 1.0 or int(medium.sum()) < 2:
        return None
    # 1/f = (1 - s)/factor + s, and s = a / wavelen + b is linear in 1 / wavelen
    s = (1.0 / f[medium] - 1.0 / factor) / (1.0 - 1.0 / factor)
    x = inv_freq[medium] / (2 * math.pi)
    a, b = np.polyfit(x.numpy(), s.numpy(), 1)
    low, high = -b * original / a, -b * original / a + original / a
    expected = inv_freq.float() / f.float()
    for low_freq, high_freq in ((round(low, 4), round(high, 4)), (low, high)):  # the config's round values first
        fitted = {"rope_type": "llama3", "factor": factor, "low_freq_factor": float(low_freq),
                  "high_freq_factor": float(high_freq), "original_max_position_embeddings": original}  # fmt: skip
        if torch.allclose(_llama3_inv_freq(inv_freq.float(), fitted), expected, rtol=1e-4, atol=0):
            return fitted
    return None
