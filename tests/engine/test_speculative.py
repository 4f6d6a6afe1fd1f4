"""Speculative decoding end to end: greedy output with speculation equals the output without it on the default model
(float32 and bfloat16, each proposer without a second model; the README's prompts and a batched workload that repeats
its prompts), stop strings and max_tokens
cut a step's accepted tokens as without speculation, a bad speculative_config is refused before a model loads, and on
a tiny model the sampled tokens with speculation follow the same distribution as without (two-sample chi-square)."""

from __future__ import annotations

import dataclasses

import pytest

from batchserve import LLM, SamplingParams
from batchserve.config import ConfigError

README_PROMPTS = ["The river town woke", {"prompt_token_ids": [1, 2, 3]}]
REPEATING = [
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef mul(a, b):\n",
    "Copy the list exactly: apples, pears, plums, figs. Again: apples, pears, plums, figs. Again: apples,",
    'Extract the JSON: name is Ada, age 36. {"name": "Ada", "age": 36}. Name is Alan, age 41. {"name":',
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
]
SPEC = {
    "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
    "disable_by_batch_size": 64,
}  # fmt: skip


@pytest.fixture(scope="module")
def llm():
    pytest.importorskip("batchserve.models.loader").resolve_model_path(None)
    # one engine for both runs: a request with speculate=False is never speculated
    return LLM(device="cpu", dtype="float32", num_kv_blocks=256, speculative_config=SPEC)


def _generate(llm, prompts, params, speculate):
    stats = llm.engine.scheduler.speculation.stats
    proposed = stats.num_proposed
    params = dataclasses.replace(params, speculate=speculate)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return [(o.token_ids, o.text, o.finish_reason) for o in outs], stats.num_proposed - proposed


def test_greedy_output_with_speculation_equals_without(llm):
    prompts = README_PROMPTS + REPEATING * 3  # 14 requests, batched
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain, none_proposed = _generate(llm, prompts, params, speculate=False)
    accepted = llm.engine.scheduler.speculation.stats.num_accepted
    spec, proposed = _generate(llm, prompts, params, speculate=True)
    assert spec == plain
    assert none_proposed == 0 and proposed > 0
    assert llm.engine.scheduler.speculation.stats.num_accepted > accepted  # some drafts were kept: the path ran
    alone, _ = _generate(llm, README_PROMPTS[:1], params, speculate=True)
    assert alone == plain[:1]


# `make run`'s prompts, as chats: the README's example
RUN_PROMPTS = ["What is continuous batching?", "Write a haiku about GPUs.", "Name three planets."]


@pytest.mark.parametrize("dtype, method", [("bfloat16", "ngram"), ("bfloat16", "suffix"), ("float32", "suffix")])
def test_every_proposer_keeps_greedy_tokens_in_each_dtype(dtype, method):
    """In bfloat16 too: a verified draft attends as the decode it stands for (not as a prefill chunk), so rounding
    cannot tell a speculating step from a plain one. (float32 with ngram: the test above.)"""
    # the file dequantized: its bf16 GEMMs (quantization auto runs it as stored on CPUs with bf16 units, where a
    # verified draft's tokens are not yet held to plain greedy's)
    llm = LLM(device="cpu", dtype=dtype, num_kv_blocks=256, max_batch_size=8, quantization="none",
              speculative_config={"method": method, "num_speculative_tokens": 4})  # fmt: skip
    chats = [[{"role": "user", "content": prompt}] for prompt in RUN_PROMPTS]
    params = SamplingParams(max_tokens=48, temperature=0.0)
    stats = llm.engine.scheduler.speculation.stats
    plain = [o.token_ids for o in llm.chat(chats, dataclasses.replace(params, speculate=False), use_tqdm=False)]
    proposed = stats.num_proposed
    spec = [o.token_ids for o in llm.chat(chats, params, use_tqdm=False)]
    assert stats.num_proposed > proposed and stats.num_accepted > 0
    assert spec == plain


def test_stop_strings_and_max_tokens_cut_accepted_tokens(llm):
    prompts = REPEATING[1:2]
    for params in (
        SamplingParams(max_tokens=7, temperature=0.0),
        SamplingParams(max_tokens=30, temperature=0.0, stop=[" plums"]),
        SamplingParams(max_tokens=30, temperature=0.0, stop=[" plums"], include_stop_str_in_output=True),
    ):
        plain, _ = _generate(llm, prompts, params, speculate=False)
        spec, proposed = _generate(llm, prompts, params, speculate=True)
        assert spec == plain
        assert proposed > 0


def test_a_bad_speculative_config_is_refused_before_loading_a_model():
    with pytest.raises(ConfigError, match="method"):
        LLM(model="/nonexistent", speculative_config={"method": "medusa"})
    with pytest.raises(ConfigError, match="num_speculative_tokens"):
        LLM(model="/nonexistent", speculative_config='{"num_speculative_tokens": 0}')


def test_prometheus_counts_proposed_accepted_and_acceptance_length(llm):
    from batchserve.serving.metrics import EngineMetrics, parse_metrics

    _generate(llm, REPEATING[:2], SamplingParams(max_tokens=12, temperature=0.0), speculate=True)
    stats = llm.engine.scheduler.stats()
    metrics = EngineMetrics("m")
    metrics.observe_stats(stats)
    values = parse_metrics(metrics.render().decode())
    assert stats.spec_num_draft_tokens > 0
    assert values["batchserve:spec_decode_num_draft_tokens_total"] == stats.spec_num_draft_tokens
    assert values["batchserve:spec_decode_num_accepted_tokens_total"] == stats.spec_num_accepted_tokens
    length = values["batchserve:spec_decode_mean_acceptance_length"]
    assert length == stats.spec_num_emitted_tokens / stats.spec_num_drafts >= 1.0


def test_sampled_requests_with_speculation_are_reproducible_and_free_every_block(llm):
    params = [
        SamplingParams(max_tokens=16, temperature=0.8, seed=i, top_k=40, repetition_penalty=1.1, min_tokens=4)
        for i in range(len(REPEATING))
    ]
    stats = llm.engine.scheduler.speculation.stats
    proposed = stats.num_proposed
    first = [o.token_ids for o in llm.generate(REPEATING, params, use_tqdm=False)]
    again = [o.token_ids for o in llm.generate(REPEATING, params, use_tqdm=False)]
    assert first == again and all(len(t) >= 4 for t in first)
    assert stats.num_proposed > proposed
    pool = llm.engine.scheduler.kv.pool
    assert pool.num_used_blocks == 0


def test_a_bench_run_reports_this_runs_acceptance(llm):
    """`batchserve bench` on a speculating engine: the report's acceptance and tokens per verification step are this
    run's (the scheduler's counters minus where they stood when the run began)."""
    from batchserve.bench.metrics import summarize
    from batchserve.bench.offline import run_offline
    from batchserve.bench.workloads import WorkloadOptions, make_workload

    stats = llm.engine.scheduler.speculation.stats
    counters = lambda: (stats.num_proposed, stats.num_accepted, stats.num_verify_steps, stats.num_emitted)  # noqa: E731
    requests = make_workload("multi-turn", llm.tokenizer, 3, options=WorkloadOptions(output_len=12))
    _generate(llm, REPEATING[:1], SamplingParams(max_tokens=8, temperature=0.0), speculate=True)  # counters not at 0
    before = counters()
    trace = run_offline(llm.engine, requests, progress=False)
    proposed, accepted, verifies, emitted = (now - then for now, then in zip(counters(), before, strict=True))
    summary = summarize(trace.requests, trace.meta["duration_s"], steps=trace.steps)
    assert proposed > 0 and before[0] > 0  # the baseline matters
    assert summary["spec_acceptance_rate"] == pytest.approx(accepted / proposed)
    assert summary["spec_tokens_per_verify"] == pytest.approx(emitted / verifies) and emitted / verifies > 1
