"""PEFT LoRA adapters made in the test on a tiny random base (tests/tiny_models.py): random non-zero B, so each
adapter changes the output, of different ranks and target modules; and transformers + PEFT's greedy tokens."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
import transformers
from torch import nn

from tests.tiny_models import hf_greedy

ALL_SEVEN = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (rank, alpha, targets, rsLoRA)
ADAPTERS = {
    "sql": (8, 16, ["q_proj", "v_proj", "down_proj"], False),
    "poet": (16, 8, ALL_SEVEN, True),
    "chat": (4, 8, ["k_proj", "o_proj", "gate_proj", "up_proj"], False),
}


@dataclass
class TinyAdapter:
    name: str
    folder: Path
    model: nn.Module  # the base with this adapter, unmerged (PEFT's LoRA layers)
    merged: nn.Module | None = None  # a copy with the adapter merged into the weights, made when first asked for


def make_adapter(base_dir: Path, folder: Path, name: str, seed: int, spec=None) -> TinyAdapter:
    from peft import LoraConfig, get_peft_model

    rank, alpha, targets, rslora = spec or ADAPTERS[name]
    torch.manual_seed(seed)
    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, attn_implementation="eager").float()
    base.generation_config.eos_token_id = None
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, use_rslora=rslora, lora_dropout=0.0)
    model = get_peft_model(base, config)
    with torch.no_grad():
        for param_name, param in model.named_parameters():
            if "lora_B" in param_name:  # PEFT starts B at zero: the adapter would change nothing
                param.normal_(0.0, 0.3)
    model.save_pretrained(folder)
    return TinyAdapter(name, folder, model.eval())


def make_adapters(base_dir: Path, root: Path, names=tuple(ADAPTERS)) -> dict[str, TinyAdapter]:
    return {name: make_adapter(base_dir, root / name, name, seed) for seed, name in enumerate(names, start=1)}


def peft_greedy(adapter: TinyAdapter, prompt: list[int], max_new_tokens: int, merged: bool = False) -> list[int]:
    """transformers + PEFT, one prompt alone: the adapter's layers as PEFT runs them, or merged into the weights."""
    if not merged:
        return hf_greedy(adapter.model, prompt, max_new_tokens)
    if adapter.merged is None:
        import copy

        adapter.merged = copy.deepcopy(adapter.model).merge_and_unload()
    return hf_greedy(adapter.merged, prompt, max_new_tokens)
