"""Speculative method draft_model on tiny transformers models that share a word-level tokenizer: greedy float32 tokens
with a draft model equal the target's alone (another random model as the draft, mostly rejected; the target itself as
its draft, all accepted), also when a small pool preempts; a draft model of another tokenizer is refused at start-up;
the config's shape (vLLM infers the method from a draft model)."""

from __future__ import annotations

import random

import pytest

from batchserve.config import ConfigError, SpeculativeConfig
from batchserve.engine.llm_engine import LLMEngine
from batchserve.models.registry import ModelLoadError
from batchserve.sampling_params import SamplingParams
from tests.tiny_models import VOCAB, build_hf_model, hf_greedy, save_word_tokenizer


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """target, draft (other weights, tied embeddings, same tokenizer), stranger (another tokenizer); the target's HF
    model."""
    made = {}
    for name, kind, word in (("target", "llama", "w"), ("draft", "llama_tied", "w"), ("stranger", "llama_tied", "v")):
        directory = made[name] = tmp_path_factory.mktemp(f"draft_{name}")
        model = build_hf_model(kind, directory)
        save_word_tokenizer(directory, word)
        if name == "target":
            made["hf"] = model
    return made


PROMPTS = [[random.Random(i).randrange(3, VOCAB) for _ in range(5 + 3 * i)] for i in range(6)]
PARAMS = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def _run(folders, draft: str | None, num_kv_blocks: int = 128) -> tuple[dict[str, list[int]], LLMEngine]:
    spec = None if draft is None else {"model": str(folders[draft]), "num_speculative_tokens": 4}
    engine = LLMEngine.from_options(
        model=str(folders["target"]), device="cpu", dtype="float32", num_kv_blocks=num_kv_blocks, block_size=8,
        speculative_config=spec,
    )  # fmt: skip
    for i, prompt in enumerate(PROMPTS):
        engine.add_prompt(str(i), prompt, PARAMS)
    tokens: dict[str, list[int]] = {}
    for _ in range(1000):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.delta_token_ids)
    assert not engine.has_unfinished_requests()
    return tokens, engine


@pytest.fixture(scope="module")
def alone(folders):
    tokens, _ = _run(folders, None)
    assert tokens["0"] == hf_greedy(folders["hf"], PROMPTS[0], PARAMS.max_tokens)  # the reference is transformers'
    return tokens


def _spec_stats(engine: LLMEngine):
    return engine.scheduler.speculation.stats


def test_greedy_tokens_with_another_draft_model_equal_the_target_alone(folders, alone):
    tokens, engine = _run(folders, "draft")
    assert tokens == alone
    stats = _spec_stats(engine)
    assert stats.num_proposed > 0 and stats.num_verify_steps > 0
    assert engine.scheduler.kv.pool.num_free_blocks == engine.scheduler.kv.pool.num_blocks  # nothing held


def test_the_target_as_its_own_draft_has_its_drafts_accepted(folders, alone):
    tokens, engine = _run(folders, "target")
    assert tokens == alone
    stats = _spec_stats(engine)
    assert stats.num_proposed > 0 and stats.acceptance_rate > 0.9, stats
    assert stats.mean_acceptance_length > 2.5, stats  # several tokens per target step


def test_a_small_pool_that_preempts_keeps_the_tokens(folders, alone):
    tokens, engine = _run(folders, "target", num_kv_blocks=12)
    assert tokens == alone
    assert engine.scheduler.num_preemptions_total > 0  # the pool was too small for all six at once
    assert _spec_stats(engine).num_accepted > 0


def test_a_draft_model_of_another_tokenizer_is_refused_at_start_up(folders):
    with pytest.raises(ModelLoadError, match="another tokenizer"):
        _run(folders, "stranger")


def test_the_config_infers_the_method_from_a_draft_model_and_refuses_half_of_one():
    assert SpeculativeConfig.from_value({"model": "some/draft"}).method == "draft_model"
    with pytest.raises(ConfigError, match="model"):
        SpeculativeConfig.from_value({"method": "draft_model"})
    with pytest.raises(ConfigError, match="model"):
        SpeculativeConfig.from_value({"method": "ngram", "model": "some/draft"})
