"""Tiny random-weight pooling models saved as folders the way their families ship: a Qwen3 decoder with
sentence-transformers' module files (Qwen3-Embedding's shape: last-token pooling, normalised), the same with mean or
CLS pooling, and a Qwen3 / Llama *ForSequenceClassification cross-encoder."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import transformers

from tests.tiny_models import COMMON, VOCAB

POOLING_KEYS = {"last": "pooling_mode_lasttoken", "mean": "pooling_mode_mean_tokens", "cls": "pooling_mode_cls_token"}


YES, NO = VOCAB - 2, VOCAB - 1  # the ids of "yes" and "no" in the tokenizer of a yes/no reranker


def save_tokenizer(directory: Path, yes_no: bool = False) -> None:
    """Word-level (w0 ... w95), w0 as padding: sentence-transformers pads a batch with it. `yes_no`: the last two
    words are "yes" and "no" (a reranker scored on them)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB)}
    if yes_no:
        vocab = {("yes" if i == YES else "no" if i == NO else word): i for word, i in vocab.items()}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="w0").save_pretrained(directory)


def _randomised(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model.float().eval()


def causal_lm_folder(directory: Path, yes_no: bool = False, head_dim: int = 24) -> transformers.Qwen3ForCausalLM:
    """A Qwen3 causal LM with tied embeddings (Qwen3-Embedding's and Qwen3-Reranker's shape); head_dim 32 or 64 is
    one the native prefill kernel takes (24 attends by SDPA)."""
    torch.manual_seed(63)
    config = transformers.Qwen3Config(**COMMON, head_dim=head_dim, tie_word_embeddings=True)
    model = _randomised(transformers.Qwen3ForCausalLM(config), 63)
    model.generation_config.eos_token_id = None  # never stop early: compare a fixed number of tokens
    model.save_pretrained(directory)
    save_tokenizer(directory, yes_no)
    return model


def embedding_folder(directory: Path, pooling: str = "last", normalize: bool = True, head_dim: int = 24) -> Path:
    """The causal LM with sentence-transformers' modules.json and 1_Pooling/config.json."""
    causal_lm_folder(directory, head_dim=head_dim)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
        (directory / "2_Normalize").mkdir()
    (directory / "modules.json").write_text(json.dumps(modules))
    (directory / "1_Pooling").mkdir()
    pooling_config = {"word_embedding_dimension": COMMON["hidden_size"], "include_prompt": True}
    pooling_config.update({key: name == pooling for name, key in POOLING_KEYS.items()})
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling_config))
    (directory / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256, "do_lower_case": False}))
    return directory


def classifier_folder(directory: Path, family: str = "qwen3", num_labels: int = 1) -> Path:
    """A *ForSequenceClassification of the tiny shape: the score head on the last token."""
    config_class = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[family]
    config = config_class(**COMMON, num_labels=num_labels, **({"head_dim": 24} if family == "qwen3" else {}))
    torch.manual_seed(64)
    model = _randomised(transformers.AutoModelForSequenceClassification.from_config(config), 64)
    model.save_pretrained(directory)
    save_tokenizer(directory)
    return directory


def words(seed: int, count: int) -> str:
    """A text of `count` words of the vocabulary, never the padding word."""
    generator = torch.Generator().manual_seed(seed)
    return " ".join(f"w{int(i)}" for i in torch.randint(1, VOCAB, (count,), generator=generator))
