"""Tiny randomly initialised transformers models (Llama, Qwen2, Mistral variants), shared by the model, worker and
engine tests. Large init scale: decisive logits, so greedy decoding has no near-ties."""

from __future__ import annotations

import weakref
from pathlib import Path

import torch
import transformers
from torch import nn

VOCAB = 96

COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,  # large weights: decisive logits, so greedy decoding has no near-ties
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)

KINDS = {
    "llama": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=False),
    "llama_tied": lambda: transformers.LlamaConfig(**COMMON, tie_word_embeddings=True),
    "llama3_rope": lambda: transformers.LlamaConfig(
        **COMMON,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 4.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        },
    ),
    "llama_linear_rope": lambda: transformers.LlamaConfig(
        **COMMON, rope_scaling={"rope_type": "linear", "factor": 2.0}
    ),
    "llama_attn_bias_mha": lambda: transformers.LlamaConfig(
        **{**COMMON, "num_key_value_heads": 4}, attention_bias=True, head_dim=8
    ),
    # head size 64, which the native prefill kernel is built for (the others run its torch fallback)
    "llama_head64": lambda: transformers.LlamaConfig(
        **{**COMMON, "hidden_size": 128, "num_attention_heads": 2, "num_key_value_heads": 1}
    ),
    # a gate/up projection wider than CpuLinear.NARROW_OUT: it gets oneDNN's packed layout in float32 too
    "llama_wide_mlp": lambda: transformers.LlamaConfig(**{**COMMON, "intermediate_size": 520}),
    "qwen2": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=False),
    "qwen2_tied": lambda: transformers.Qwen2Config(**COMMON, tie_word_embeddings=True),
    "mistral": lambda: transformers.MistralConfig(**COMMON, sliding_window=None),
}

# Models with sliding-window layers (window 8: prompts of a few dozen tokens span several windows), built by
# build_hf_model like KINDS but tested in test_gemma.py / test_sliding_window.py; untied output matrices except
# gemma3_tied (tied ones echo their input token, so greedy tokens would barely depend on the window).
GEMMA = dict(COMMON, num_hidden_layers=4, head_dim=16, sliding_window=8, query_pre_attn_scalar=24)
WINDOWED_KINDS = {
    "gemma2": lambda: transformers.Gemma2Config(
        **GEMMA, tie_word_embeddings=False, attn_logit_softcapping=5.0, final_logit_softcapping=8.0
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **GEMMA,
        tie_word_embeddings=False,
        sliding_window_pattern=2,
        rope_scaling={"rope_type": "linear", "factor": 2.0},
        rope_local_base_freq=1000.0,
    ),
    "gemma3_tied": lambda: transformers.Gemma3TextConfig(**GEMMA, tie_word_embeddings=True, sliding_window_pattern=3),
    "mistral_window": lambda: transformers.MistralConfig(**COMMON, sliding_window=8),
    # Qwen's use_sliding_window: the window on the layers from max_window_layers on (here the second of two)
    "qwen2_window": lambda: transformers.Qwen2Config(
        **COMMON, tie_word_embeddings=False, use_sliding_window=True, sliding_window=8, max_window_layers=1
    ),
}

# Architectures beyond the Llama family's first kinds (tests/models/test_architectures.py). RoPE scalings
# that depend on the sequence length get a short original context (24 or 32), so generations cross it.
SCALED = {**COMMON, "max_position_embeddings": 24}
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0 + 0.15 * i for i in range(8)],
            "long_factor": [1.5 + 0.5 * i for i in range(8)]}  # fmt: skip
ARCH_KINDS = {
    "qwen3": lambda: transformers.Qwen3Config(**COMMON, head_dim=24, tie_word_embeddings=False),
    "llama_yarn": lambda: transformers.LlamaConfig(
        **COMMON, rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    ),
    "llama_dynamic": lambda: transformers.LlamaConfig(**SCALED, rope_scaling={"rope_type": "dynamic", "factor": 2.0}),
    "phi3": lambda: transformers.Phi3Config(
        **{**COMMON, "max_position_embeddings": 128}, original_max_position_embeddings=32, rope_scaling=LONGROPE
    ),
    "phi3_window": lambda: transformers.Phi3Config(**COMMON, sliding_window=8),  # Phi-3-mini-4k's is 2047
    # Phi-4-mini's shape of it: partial rotary (12 of 16 dims), tied embeddings
    "phi4_mini": lambda: transformers.Phi3Config(
        **{**COMMON, "max_position_embeddings": 128},
        original_max_position_embeddings=32,
        partial_rotary_factor=0.75,
        tie_word_embeddings=True,
        rope_scaling={
            **LONGROPE,
            "short_factor": LONGROPE["short_factor"][:6],
            "long_factor": LONGROPE["long_factor"][:6],
            "partial_rotary_factor": 0.75,
        },
    ),  # fmt: skip
}


def build_hf_model(kind: str, directory: Path) -> nn.Module:
    """Build, randomise (biases and norms too, which HF initialises to constants) and save a tiny model."""
    torch.manual_seed(sum(map(ord, kind)))
    config = {**KINDS, **WINDOWED_KINDS, **ARCH_KINDS}[kind]()
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.5)
            elif "norm" in name:
                param.uniform_(0.5, 1.5)
    model.generation_config.eos_token_id = None  # never stop early: compare a fixed number of tokens
    model.save_pretrained(directory)
    return model


def save_word_tokenizer(directory: Path, word: str = "w") -> None:
    """A word-level tokenizer over the tiny vocabulary (word0 ... word95), saved beside a tiny model: an engine loads
    it as a model's own."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"{word}{i}": i for i in range(VOCAB)}, unk_token=f"{word}0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(directory)


def text_after(tokenizer, prompt: list[int], output: list[int]) -> str:
    """`output`'s text as the engine streams it: read after the prompt's last tokens (engine/detokenizer.py), so a
    word tokenizer's first output word keeps the space before it."""
    from batchserve.engine.detokenizer import CONTEXT_TOKENS

    tail = prompt[-CONTEXT_TOKENS:]
    return tokenizer.decode(tail + output)[len(tokenizer.decode(tail)) :]


def tiny_checkpoint(tmp_path_factory, kind: str, name: str) -> tuple[nn.Module, Path]:
    """A tiny random `kind` model and its word-level tokenizer saved in a fresh folder `name`: (HF model, folder)."""
    directory = tmp_path_factory.mktemp(name)
    model = build_hf_model(kind, directory)
    save_word_tokenizer(directory)
    return model, directory


# transformers' greedy tokens per model object, by prompt, length and the state of its weights: a test run once per
# path of ours (the native loop, the Python layers) compares each with the one reference run
_GREEDY: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def hf_greedy(model: nn.Module, prompt: list[int], max_new_tokens: int) -> list[int]:
    weights = tuple((p.data_ptr(), p.dtype, p._version) for p in model.parameters())  # in place or replaced: a new key
    known = _GREEDY.setdefault(model, {})
    key = (tuple(prompt), max_new_tokens, weights)
    if key not in known:
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, attention_mask=None
        )
        known[key] = out[0, len(prompt) :].tolist()
    return list(known[key])
