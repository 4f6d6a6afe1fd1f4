"""llama.cpp's GGUF LoRA files (what its convert_lora_to_gguf.py writes) read as the PEFT tensors they came from.

Such a file says `general.type = adapter`, `adapter.type = lora` and `adapter.lora.alpha`; each adapted projection
is two tensors named after the base tensor, `blk.<i>.attn_q.weight.lora_a` (A [r, in]) and `....lora_b` (B [out, r]).
The converter permutes a `llama` model's q and k rows for llama.cpp's RoPE, in B as in the base weights: undone here
as the base's loading undoes it. The scale is llama.cpp's: alpha / r (1 where alpha is 0); a GGUF file has no rsLoRA.
"""

from __future__ import annotations

from pathlib import Path

import torch

from batchserve.config import ConfigError, ModelConfig
from batchserve.models.gguf_config import gguf_reader
from batchserve.models.gguf_weights import dequantize_as, unpermute_qk

PERMUTED_ARCHITECTURES = ("llama",)  # convert_hf_to_gguf.py permutes q/k rows for these


def is_gguf_lora(path: Path) -> bool:
    return path.is_file() and path.suffix == ".gguf"


def read_gguf_lora(path: Path, config: ModelConfig, error: type[ConfigError]) -> tuple[int, float, dict]:
    """(rank, scale, {PEFT key: tensor}) of the GGUF LoRA file `path` for a base of `config`; `error` (naming the
    file and what is wrong) where it is not one."""
    from batchserve.models.loader import gguf_name_map  # it builds on this package's GGUF readers

    try:
        reader = gguf_reader(path)
    except (OSError, ValueError) as exc:
        raise error(f"{path}: not a readable GGUF file ({exc})") from None
    fields = {key: field.contents() for key, field in reader.fields.items() if key.startswith(("general.", "adapter."))}
    kind, adapter_type = fields.get("general.type"), fields.get("adapter.type")
    if kind != "adapter" or adapter_type != "lora":
        raise error(f"{path}: not a GGUF LoRA adapter (general.type {kind!r}, adapter.type {adapter_type!r})")
    to_hf = gguf_name_map(config)
    permuted = fields.get("general.architecture") in PERMUTED_ARCHITECTURES
    tensors = {}
    for tensor in reader.tensors:
        base, _, part = tensor.name.rpartition(".")
        hf_name = to_hf(base) if part in ("lora_a", "lora_b") else None
        if hf_name is None or not hf_name.endswith(".weight"):
            raise error(f"{path}: tensor {tensor.name} is not the lora_a or lora_b of a decoder projection")
        try:
            value = dequantize_as(tensor, torch.float32)
        except ConfigError as exc:
            raise error(f"{path}: {exc}") from None
        if permuted and part == "lora_b" and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            value = unpermute_qk(value, config.num_heads if "q_proj" in hf_name else config.num_kv_heads)
        suffix = ".lora_A.weight" if part == "lora_a" else ".lora_B.weight"
        tensors["base_model.model." + hf_name.removesuffix(".weight") + suffix] = value.contiguous()
    ranks = {t.shape[0] for key, t in tensors.items() if key.endswith("lora_A.weight") and t.dim() == 2}
    if len(ranks) != 1:
        raise error(f"{path}: LoRA A tensors of ranks {sorted(ranks)}; an adapter is served with one rank")
    rank = ranks.pop()
    alpha = float(fields.get("adapter.lora.alpha") or 0.0)
    return rank, alpha / rank if alpha else 1.0, tensors
