"""--deterministic end to end (docs/determinism.md): a bfloat16 request's tokens and logprobs (their float32 bits) do
not depend on the scheduler configuration, the batch it shares, chunked prefill, preemption (recompute or swap) or
prefix-cache hits, greedy and seeded sampling alike. A tiny Llama with head size 64 (the native kernels' size)."""

from __future__ import annotations

import pytest

from batchserve import LLM, SamplingParams
from tests.tiny_models import build_hf_model, save_word_tokenizer

PREFIX = [7, 21, 33, 4, 58, 12, 9, 40, 77, 3, 19, 64, 25, 31, 8, 50, 11]  # over a block: prefix-cache hits
PROMPTS = [
    PREFIX + [5, 17],
    [40, 41, 3, 9, 11],
    PREFIX + [60, 61, 62, 63, 70, 71, 72, 80, 81, 82, 83, 84, 85, 86],
    [9] * 3 + list(range(10, 45)),
    PREFIX,
    [88, 2 + 1, 44],
    list(range(50, 90, 2)),
    PREFIX + [90],
]
TOKENS = 20

# one configuration per way the batch around a request changes; preempting ones check that they did preempt
CONFIGS = {
    "large pool": dict(num_kv_blocks=256, enable_prefix_caching=False),
    "tiny pool, recompute": dict(num_kv_blocks=9, preemption_mode="recompute", enable_prefix_caching=False),
    "tiny pool, swap": dict(num_kv_blocks=9, preemption_mode="swap", swap_space_gb=0.01, enable_prefix_caching=False),
    "guaranteed_no_evict": dict(num_kv_blocks=20, scheduler_policy="guaranteed_no_evict"),
    "static": dict(num_kv_blocks=256, scheduler_policy="static", enable_prefix_caching=False),
    "chunked prefill, 16 tokens a step": dict(num_kv_blocks=256, max_num_tokens=16, enable_prefix_caching=False),
    "chunked prefill, 23 tokens a step": dict(num_kv_blocks=256, max_num_tokens=23, enable_prefix_caching=False),
    "prefix caching": dict(num_kv_blocks=256, enable_prefix_caching=True),
}
PREEMPTING = {"tiny pool, recompute", "tiny pool, swap"}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama_deterministic")
    build_hf_model("llama_head64", directory)
    save_word_tokenizer(directory)
    return directory


def _params(sampled: bool) -> list[SamplingParams]:
    if not sampled:
        return [SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)] * len(PROMPTS)
    return [
        SamplingParams(max_tokens=TOKENS, temperature=1.0, seed=100 + i, ignore_eos=True, logprobs=0)
        for i in range(len(PROMPTS))
    ]


def _fingerprints(llm: LLM, indices: list[int], sampled: bool, preemptions: list[int] | None = None) -> dict:
    """Each request's tokens and the float32 logprob of each, keyed by prompt index; `preemptions` gets the runs'."""
    params = _params(sampled)
    outs = llm.generate([{"prompt_token_ids": PROMPTS[i]} for i in indices], [params[i] for i in indices],
                        use_tqdm=False)  # fmt: skip
    if preemptions is not None:
        preemptions.extend(out.metrics.num_preemptions for out in outs)
    return {
        i: (tuple(out.token_ids), tuple(lp.logprob for lp in out.logprobs))
        for i, out in zip(indices, outs, strict=True)
    }


def _llm(tiny_dir, **options) -> LLM:
    return LLM(model=str(tiny_dir), dtype="bfloat16", device="cpu", deterministic=True, max_batch_size=8, **options)


@pytest.mark.parametrize("sampled", [False, True], ids=["greedy", "seeded sampling"])
def test_tokens_do_not_depend_on_the_scheduler_configuration(tiny_dir, sampled):
    everything = list(range(len(PROMPTS)))
    results = {}
    for name, options in CONFIGS.items():
        llm = _llm(tiny_dir, **options)
        if name == "prefix caching":
            _fingerprints(llm, everything, sampled)  # the prompts' blocks cached; the run below hits them
        preemptions: list[int] = []
        results[name] = _fingerprints(llm, everything, sampled, preemptions)
        assert (sum(preemptions) > 0) == (name in PREEMPTING), name
        if name == "prefix caching":
            assert llm.engine.scheduler.kv.pool.num_cached_free_blocks > 0
    reference = results["large pool"]
    assert all(len(tokens) == TOKENS for tokens, _ in reference.values())
    for name, got in results.items():
        assert got == reference, name


def test_alone_equals_mixed(tiny_dir):
    """Each request alone, then all together (and in another order): the same tokens and logprob bits."""
    llm = _llm(tiny_dir, num_kv_blocks=256, enable_prefix_caching=False)
    everything = list(range(len(PROMPTS)))
    mixed = _fingerprints(llm, everything, sampled=True)
    reversed_order = _fingerprints(llm, everything[::-1], sampled=True)
    alone = {}
    for i in (0, 3, 6):
        alone.update(_fingerprints(llm, [i], sampled=True))
    assert reversed_order == mixed
    assert all(alone[i] == mixed[i] for i in alone)


def test_deterministic_mode_is_in_the_effective_configuration(tiny_dir):
    """What batchserve:engine_config_info reports (effective_config)."""
    llm = _llm(tiny_dir, num_kv_blocks=32)
    assert llm.engine.effective_config()["deterministic"] == "True"


QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three prime numbers.",
    "Translate 'good morning' into Spanish.",
]
DEFAULT_MODEL_CONFIGS = {
    "large pool": dict(num_kv_blocks=128, enable_prefix_caching=False),
    "tiny pool, recompute": dict(num_kv_blocks=7, enable_prefix_caching=False),
    "chunked prefill, 19 tokens a step": dict(num_kv_blocks=128, max_num_tokens=19, enable_prefix_caching=False),
    "prefix caching": dict(num_kv_blocks=128, enable_prefix_caching=True),
}


@pytest.mark.slow
def test_default_model_chat_tokens_do_not_depend_on_the_configuration():
    """The issue's case on SmolLM2 in bf16: chat prompts, greedy, four configurations and each prompt alone (this test
    found the norm's alignment-dependent sum: one row at layer 10 apart when prefilled in chunks of 16)."""
    from batchserve.models.loader import resolve_model_path

    try:
        resolve_model_path(None)
    except Exception as exc:  # noqa: BLE001  (whatever stops the default model from loading: not installed here)
        pytest.skip(f"default model not installed: {exc}")
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logprobs=0)
    conversations = [[{"role": "user", "content": q}] for q in QUESTIONS]
    results = {}
    for name, options in DEFAULT_MODEL_CONFIGS.items():
        # the bf16 model dequantized, the case (quantization auto would run the file as stored on CPUs with
        # bf16 units: its own test, tests/engine/test_auto_quantization.py)
        llm = LLM(dtype="bfloat16", device="cpu", deterministic=True, max_batch_size=8, quantization="none", **options)
        runs = 2 if name == "prefix caching" else 1  # the second run hits the first one's blocks
        for _ in range(runs):
            outs = llm.chat(conversations, params, use_tqdm=False)
        results[name] = [(tuple(o.token_ids), tuple(lp.logprob for lp in o.logprobs)) for o in outs]
        if name == "large pool":
            results["alone"] = [
                (tuple(o.token_ids), tuple(lp.logprob for lp in o.logprobs))
                for c in conversations[:3]
                for o in llm.chat([c], params, use_tqdm=False)
            ]
    assert "Paris" in llm.tokenizer.decode(results["large pool"][0][0])
    for name, got in results.items():
        expected = results["large pool"][: len(got)]
        assert got == expected, name
