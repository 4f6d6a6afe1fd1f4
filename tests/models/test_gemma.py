"""Gemma 2 and Gemma 3 text (models/gemma.py) against transformers: config reading, logits, and greedy generation
through ModelRunner with prompts longer than the sliding window, chunked prefill mixed with other requests' decodes,
by the native decoder loop (the model's op plan) and by the Python layers with their windowed attention path."""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from batchserve.layers import attention, kernels
from batchserve.layers.capabilities import Capability
from batchserve.models import gemma
from tests.models.conftest import CountingLoop, MiniScheduler, load_ours, make_runner
from tests.models.test_llama import our_prefill_logits, prompt_ids
from tests.tiny_models import hf_greedy

GEMMA_KINDS = ["gemma2", "gemma3", "gemma3_tied"]


def test_config_read_from_hf_directory(tiny_models):
    config, _ = load_ours(tiny_models("gemma2")[1])
    settings = gemma.GemmaSettings.of(config)
    assert config.architecture == "gemma2" and config.head_dim == 16 and not config.tie_word_embeddings
    assert settings.layer_types == ("sliding_attention", "full_attention") * 2
    assert (settings.sliding_window, settings.query_pre_attn_scalar) == (8, 24.0)
    assert (settings.attn_softcap, settings.final_softcap) == (5.0, 8.0)
    config, _ = load_ours(tiny_models("gemma3")[1])
    settings = gemma.GemmaSettings.of(config)
    assert settings.layer_types == ("sliding_attention", "full_attention") * 2  # sliding_window_pattern=2
    assert settings.attn_softcap is None and settings.local_rope_theta == 1000.0
    assert config.rope_theta == 1_000_000.0 and config.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_transformers_4_config_spelling():
    """rope_theta / rope_scaling / rope_local_base_freq / sliding_window_pattern, as Hub checkpoints spell them."""
    hf = {"model_type": "gemma3_text", "num_hidden_layers": 12, "hidden_size": 64, "num_attention_heads": 4,
          "head_dim": 256, "rope_theta": 1e6, "rope_local_base_freq": 1e4, "sliding_window": 512,
          "rope_scaling": {"rope_type": "linear", "factor": 8.0}, "query_pre_attn_scalar": 256}  # fmt: skip
    fields = gemma.config_fields(hf)
    extra = fields["extra"]
    assert extra["layer_types"] == ("sliding_attention",) * 5 + ("full_attention",) + ("sliding_attention",) * 5 + (
        "full_attention",
    )
    assert extra["local_rope_theta"] == 1e4 and fields["rope_theta"] == 1e6
    assert fields["rope_scaling"] == {"rope_type": "linear", "factor": 8.0}
    assert fields["tie_word_embeddings"] is True  # Gemma's default when config.json does not say


@pytest.mark.parametrize("kind", GEMMA_KINDS)
def test_logits_match_transformers(tiny_models, kind):
    hf, directory = tiny_models(kind)
    config, model = load_ours(directory)
    tokens = prompt_ids(1, 40)  # five windows long
    ours = our_prefill_logits(model, config, tokens, block_size=4)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def widened_window_greedy(hf, prompt: list[int], max_new: int) -> list[int]:
    """transformers' greedy tokens for the same weights with no window: a test whose tokens equal these would not
    show that the window is honoured."""
    config = type(hf.config).from_dict({**hf.config.to_dict(), "sliding_window": 4096})
    wide = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    wide.load_state_dict(hf.state_dict())
    wide.generation_config.eos_token_id = None
    return hf_greedy(wide, prompt, max_new)


@pytest.mark.parametrize("native_loop", [True, False])
@pytest.mark.parametrize("kind,block_size,chunk", [("gemma2", 4, 5), ("gemma3", 8, 3), ("gemma3_tied", 16, 16)])
def test_greedy_generation_matches_transformers(tiny_models, monkeypatch, kind, block_size, chunk, native_loop):
    """Prompts longer than the window (8), chunked, sharing steps with another request's decodes; run by the native
    decoder loop (its op plan: GeGLU, sandwich norms, windows, soft-caps) or by the Python layers, where every windowed
    layer takes the windowed attention."""
    hf, directory = tiny_models(kind)
    windowed_calls = []

    def spy(*args):
        windowed_calls.append(args[-2])  # the window (None: a global layer with soft-capped scores)
        return real(*args)

    real = attention.windowed_attention
    monkeypatch.setattr(attention, "windowed_attention", spy)
    if not native_loop:
        monkeypatch.setenv("BATCHSERVE_NATIVE_DECODER_LOOP", "0")
    runner = make_runner(directory, block_size=block_size, num_kv_blocks=96)
    model = runner.model
    assert Capability.SLIDING_WINDOW in model.capabilities
    loop_runs = native_loop and kernels.load() is not None
    assert (model.decoder_loop is not None) == loop_runs
    if loop_runs:
        model.decoder_loop = counter = CountingLoop(model.decoder_loop)
    prompts = {"a": prompt_ids(2, 37), "b": prompt_ids(3, 4), "c": prompt_ids(4, 20)}
    sched = MiniScheduler(runner, chunk=chunk)
    sched.add("b", prompts["b"], 16)
    outputs = sched.run(hooks={2: lambda s: s.add("a", prompts["a"], 10), 3: lambda s: s.add("c", prompts["c"], 5)})
    assert outputs["a"] == hf_greedy(hf, prompts["a"], 10)
    assert outputs["b"] == hf_greedy(hf, prompts["b"], 16)
    assert outputs["c"] == hf_greedy(hf, prompts["c"], 5)
    if loop_runs:
        assert counter.calls > 0 and not windowed_calls, "the native loop ran every step"
    else:
        assert 8 in windowed_calls
    if kind == "gemma2":
        assert outputs["a"] != widened_window_greedy(hf, prompts["a"], 10), "the window must change these tokens"


@pytest.mark.parametrize("kind", ["gemma2", "gemma3"])
def test_bfloat16_as_near_float32_as_transformers_bfloat16(tiny_models, kind):
    """bf16 weights and pool: our logits are about as far from transformers' float32 ones as transformers' own bf16
    model's are (mean error within 1.5x of it, the argmax as often right)."""
    hf, directory = tiny_models(kind)
    config, model = load_ours(directory, dtype=torch.bfloat16)
    tokens = prompt_ids(5, 30)
    ours = our_prefill_logits(model, config, tokens, block_size=4, dtype=torch.bfloat16).float()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
        theirs = copy.deepcopy(hf).to(torch.bfloat16)(torch.tensor([tokens])).logits[0].float()
    assert (ours - ref).abs().mean() <= 1.5 * (theirs - ref).abs().mean()
    agreement = [(x.argmax(-1) == ref.argmax(-1)).float().mean() for x in (ours, theirs)]
    assert agreement[0] >= agreement[1] - 0.1
