"""LongRoPE past the original context, through the real scheduler, against transformers' generate on a tiny Phi-3
(original context 32): a prompt longer than it is rotated with the long factors from its first token (chunked
prefill too), a generation that outgrows it starts over with the long factors as transformers recomputes it, and a
long sequence never takes a short one's cached blocks; greedy float32 tokens equal transformers' in one batch, with
n-gram speculation too (its drafts stop at the original context). And an 8,000-token prompt, chunked and then hit
in the prefix cache, on a tiny Llama whose context holds it."""

from __future__ import annotations

import pytest

from batchserve.engine.llm_engine import LLMEngine
from batchserve.sampling_params import SamplingParams
from tests.models.test_llama import prompt_ids
from tests.tiny_models import hf_greedy, tiny_checkpoint

ORIGINAL = 32  # tests/tiny_models.py ARCH_KINDS["phi3"]


@pytest.fixture(scope="module")
def phi3(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "phi3", "tiny_phi3_long")


CROSSING = prompt_ids(7, 20)
PROMPTS = {
    "long": prompt_ids(5, 40),  # past the original context from the start
    "crossing": CROSSING,  # 20 + 24 tokens: outgrows it at its 13th generated token
    "short": prompt_ids(6, 10),  # 10 + 12: never reaches it
    "shares_a_prefix": CROSSING + prompt_ids(8, 18),  # long, its first blocks those "crossing" computed short
}
MAX_NEW = {"long": 10, "crossing": 24, "short": 12, "shares_a_prefix": 8}


def _generate(directory, **options) -> tuple[dict[str, list[int]], LLMEngine]:
    engine = LLMEngine.from_options(
        model=str(directory), device="cpu", dtype="float32", num_kv_blocks=64, block_size=8, max_num_tokens=16,
        **options,
    )  # fmt: skip
    tokens: dict[str, list[int]] = {}
    for name in ("crossing", "short"):
        engine.add_prompt(name, PROMPTS[name], SamplingParams(max_tokens=MAX_NEW[name], temperature=0.0))
    for step in range(500):
        if step == 3:  # "crossing" has cached its prompt's blocks by now
            for name in ("long", "shares_a_prefix"):
                engine.add_prompt(name, PROMPTS[name], SamplingParams(max_tokens=MAX_NEW[name], temperature=0.0))
        if step > 3 and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.delta_token_ids)
    return tokens, engine


@pytest.mark.parametrize(
    "speculative", [None, {"method": "ngram", "prompt_lookup_min": 1, "disable_by_batch_size": 64}]
)
def test_greedy_tokens_past_the_original_context_are_transformers(phi3, speculative):
    hf, directory = phi3
    tokens, engine = _generate(directory, speculative_config=speculative)
    for name, prompt in PROMPTS.items():
        assert tokens[name] == hf_greedy(hf, prompt, MAX_NEW[name]), name
    assert engine.model_config.long_context_from == ORIGINAL


def test_the_per_position_rule_gives_other_tokens(phi3, monkeypatch):
    """The check above can fail: rotating only the positions past the original context with the long factors (what
    the engine did before, without the start-over or the salt) gives tokens other than transformers'."""
    from batchserve.config import ModelConfig

    hf, directory = phi3
    monkeypatch.setattr(ModelConfig, "long_context_from", property(lambda self: None))
    tokens, _ = _generate(directory)
    assert tokens["short"] == hf_greedy(hf, PROMPTS["short"], MAX_NEW["short"])
    differ = [name for name in ("long", "crossing", "shares_a_prefix")
              if tokens[name] != hf_greedy(hf, PROMPTS[name], MAX_NEW[name])]  # fmt: skip
    assert differ, "the long factors must change these tokens"


# An 8k-token prompt on a tiny Llama with head size 64 (the native prefill kernel's) and a context wide enough for it
LONG_PROMPT = prompt_ids(11, 8000)
LONG_MAX_NEW = 6


@pytest.fixture(scope="module")
def llama_8k(tmp_path_factory):
    import torch
    import transformers

    from tests.tiny_models import COMMON, save_word_tokenizer

    directory = tmp_path_factory.mktemp("tiny_llama_8k")
    torch.manual_seed(8000)
    config = transformers.LlamaConfig(**{**COMMON, "hidden_size": 128, "num_attention_heads": 2,
                                         "num_key_value_heads": 1, "max_position_embeddings": 8192})  # fmt: skip
    # sdpa, not eager: eager would hold 8k x 8k scores per head (GBs); both are transformers' reference attention
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float().eval()
    model.generation_config.eos_token_id = None
    model.save_pretrained(directory)
    save_word_tokenizer(directory)
    return model, directory


def test_greedy_tokens_after_an_8k_prompt_are_transformers(llama_8k):
    """An 8,000-token prompt prefilled in four chunks, then asked again with another ending (a prefix-cache hit on
    all its full blocks): both generations equal transformers' greedy tokens."""
    hf, directory = llama_8k
    engine = LLMEngine.from_options(
        model=str(directory), device="cpu", dtype="float32", num_kv_blocks=1100, block_size=16, max_num_tokens=2048,
    )  # fmt: skip
    second = LONG_PROMPT[:7990] + prompt_ids(12, 12)
    done = {}
    for name, prompt in (("first", LONG_PROMPT), ("second", second)):
        engine.add_prompt(name, prompt, SamplingParams(max_tokens=LONG_MAX_NEW, temperature=0.0))
        steps = 0
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.extend(out.delta_token_ids)
                if out.finished:
                    done[name] = out
            steps += 1
        assert tokens == hf_greedy(hf, prompt, LONG_MAX_NEW), name
        if name == "first":
            assert steps >= 4 + LONG_MAX_NEW - 1  # four prefill chunks of at most 2048 tokens
    assert done["first"].metrics.num_cached_tokens == 0
    assert done["second"].metrics.num_cached_tokens == 7984  # 499 full blocks of the shared 7,990 tokens
