"""What a pooling runner computes, read from the model folder once at start-up (docs/embeddings.md): the runner
(generate or pooling) and the task (embed or classify) as vLLM decides them, the pooling method and normalisation
(sentence-transformers' modules.json and its Pooling module's config.json), and a classifier's head."""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from batchserve.config import Convert, EngineConfig, ModelConfig, Runner
from batchserve.models.registry import ModelLoadError

logger = logging.getLogger(__name__)

POOLING_MODULE = "sentence_transformers.models.Pooling"
NORMALIZE_MODULE = "sentence_transformers.models.Normalize"
TRANSFORMER_MODULE = "sentence_transformers.models.Transformer"
# Pooling config keys -> our method; a folder asking for another (max, weighted mean...) is refused by name
POOLING_MODES = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
YES_NO = ("yes", "no")  # a causal LM as a reranker: score = sigmoid(logit("yes") - logit("no")) at the last token


@dataclass(frozen=True)
class PoolerConfig:
    """`method`: last, mean or cls; `normalize`: the embedding's default (a request may say otherwise); `head`:
    [labels, hidden] for classify; `generates`: the model has its LM head, so generation requests may share steps."""

    method: str
    normalize: bool
    task: Convert
    head: torch.Tensor | None = None
    generates: bool = True

    @property
    def num_labels(self) -> int:
        return 0 if self.head is None else int(self.head.shape[0])


def folder_facts(path: Path) -> dict[str, Any]:
    """config.json's architectures and labels, and the sentence-transformers modules, of a model folder ({} else)."""
    if not path.is_dir() or not (path / "config.json").is_file():
        return {}
    cfg = json.loads((path / "config.json").read_text())
    modules_file = path / "modules.json"
    modules = json.loads(modules_file.read_text()) if modules_file.is_file() else []
    return {"architectures": cfg.get("architectures") or [], "id2label": cfg.get("id2label"), "modules": modules,
            "num_labels": cfg.get("num_labels")}  # fmt: skip


def is_classifier(facts: dict[str, Any]) -> bool:
    return any(str(a).endswith("ForSequenceClassification") for a in facts.get("architectures", ()))


def resolve_runner(config: EngineConfig, path: Path) -> None:
    """config.runner and config.convert as the engine runs them (auto decided from the folder), set in place."""
    facts = folder_facts(path)
    has_pooling_module = any(m.get("type") == POOLING_MODULE for m in facts.get("modules", ()))
    if config.runner == Runner.AUTO:
        config.runner = Runner.POOLING if is_classifier(facts) or has_pooling_module else Runner.GENERATE
    if config.runner == Runner.GENERATE:
        config.convert = Convert.AUTO  # no pooling task: /v1/models says generate
    elif config.convert == Convert.AUTO:
        config.convert = Convert.CLASSIFY if is_classifier(facts) else Convert.EMBED
    if config.runner == Runner.POOLING and facts == {}:
        raise ModelLoadError(f"--runner pooling needs a Hugging Face model folder with config.json, not {path}")


def checkpoint_names(path: Path) -> set[str]:
    """The tensor names of a folder's safetensors (headers only)."""
    from safetensors import safe_open

    names: set[str] = set()
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names.update(f.keys())
    return names


def checkpoint_tensor(path: Path, name: str) -> torch.Tensor | None:
    from safetensors import safe_open

    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            if name in f.keys():
                return f.get_tensor(name)
    return None


def pooling_model_config(path: Path, model_config: ModelConfig) -> tuple[ModelConfig, bool]:
    """The model config to load for pooling, and whether the model can generate: a checkpoint without an output
    matrix (a classifier, a sentence-transformers base model) loads its embedding table in that place, unused."""
    names = checkpoint_names(path)
    has_head = model_config.tie_word_embeddings or "lm_head.weight" in names
    if has_head and not is_classifier(folder_facts(path)):
        return model_config, True
    return dataclasses.replace(model_config, tie_word_embeddings=True), False


def pooler_config(path: Path, config: EngineConfig, generates: bool, tokenizer) -> PoolerConfig:
    """The pooling method, normalisation and head of a pooling runner's model."""
    facts = folder_facts(path)
    if config.convert == Convert.CLASSIFY:
        return PoolerConfig("last", False, Convert.CLASSIFY, classifier_head(path, facts, tokenizer), False)
    method, normalize = "last", True  # a decoder's embedding without a folder that says otherwise (vLLM's default)
    types = [m.get("type") for m in facts.get("modules", ())]
    for module in facts.get("modules", ()):
        if module.get("type") == POOLING_MODULE:
            method = _pooling_method(json.loads((path / module["path"] / "config.json").read_text()))
            normalize = NORMALIZE_MODULE in types
    unknown = [t for t in types if t not in (POOLING_MODULE, NORMALIZE_MODULE, TRANSFORMER_MODULE)]
    if unknown:
        raise ModelLoadError(f"sentence-transformers modules {unknown} are not supported (Transformer, Pooling and "
                             "Normalize are)")  # fmt: skip
    return PoolerConfig(method, normalize, Convert.EMBED, None, generates)


def _pooling_method(pooling: dict[str, Any]) -> str:
    chosen = [method for key, method in POOLING_MODES.items() if pooling.get(key)]
    others = [k for k, v in pooling.items() if k.startswith("pooling_mode_") and v and k not in POOLING_MODES]
    if others or len(chosen) != 1:
        raise ModelLoadError(f"the Pooling module asks for {others or chosen or 'no pooling'}: one of "
                             f"{sorted(POOLING_MODES)} is supported")  # fmt: skip
    if pooling.get("include_prompt") is False:
        raise ModelLoadError("the Pooling module's include_prompt=false is not supported")
    return chosen[0]


def classifier_head(path: Path, facts: dict[str, Any], tokenizer) -> torch.Tensor:
    """[labels, hidden] float32: a *ForSequenceClassification's `score` matrix, or for a causal LM the difference of
    its "yes" and "no" output rows (Qwen3-Reranker's scoring: one label, sigmoid)."""
    score = checkpoint_tensor(path, "score.weight")
    if score is not None:
        return score.float()
    if is_classifier(facts):
        raise ModelLoadError(f"{path} names a classification architecture but holds no score.weight")
    output = checkpoint_tensor(path, "lm_head.weight")
    if output is None:
        output = checkpoint_tensor(path, "model.embed_tokens.weight")
    if output is None:
        raise ModelLoadError(
            f"--convert classify on {path}: no score.weight, lm_head.weight or embedding to score with"
        )
    ids = [tokenizer.convert_tokens_to_ids(token) for token in YES_NO]
    if any(i is None or i == tokenizer.unk_token_id for i in ids):
        raise ModelLoadError(f"--convert classify on a causal LM scores with the tokens {YES_NO}: its tokenizer lacks "
                             "them")  # fmt: skip
    logger.info("classify: a causal LM scored as yes/no (token ids %s)", ids)
    return (output[ids[0]].float() - output[ids[1]].float()).unsqueeze(0)
