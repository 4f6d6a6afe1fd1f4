"""The pooling runner (docs/embeddings.md) against the references: embeddings of tiny random-weight models equal
sentence-transformers' on the same folder (last-token, mean and CLS pooling; chunked prompts; batched with
generation traffic, whose greedy tokens still equal transformers'), scores equal transformers'
ForSequenceClassification (and a causal LM's yes/no logits), and what is refused says which field or server."""

from __future__ import annotations

import pytest
import torch
import transformers

from batchserve.engine.llm_engine import LLMEngine
from batchserve.entrypoints.llm import LLM
from batchserve.layers import attention, kernels
from batchserve.layers.kernels import paths
from batchserve.pooling_params import PoolingTask
from batchserve.sampling_params import InvalidRequestError, SamplingParams
from batchserve.serving.pooling import pooling_sampling_params
from tests.lazy import sentence_transformers
from tests.pooling_models import NO, YES, causal_lm_folder, classifier_folder, embedding_folder, words
from tests.tiny_models import hf_greedy

TOLERANCE = 1e-5
TEXTS = [words(seed, 3 + 7 * seed) for seed in range(7)]  # 3 to 45 words: several chunks of 16 tokens


def reference_embeddings(folder, texts) -> torch.Tensor:
    model = sentence_transformers.SentenceTransformer(str(folder), device="cpu")
    return model.encode(texts, convert_to_tensor=True, batch_size=3).float()


@pytest.fixture(scope="module", params=["last", "mean", "cls"])
def embedder(request, tmp_path_factory):
    normalize = request.param != "mean"  # one folder without the Normalize module
    folder = embedding_folder(tmp_path_factory.mktemp(f"embed-{request.param}"), request.param, normalize)
    return folder, LLM(str(folder), dtype="float32", max_num_tokens=16, max_batch_size=4)


def test_embeddings_equal_sentence_transformers(embedder):
    folder, llm = embedder
    assert (llm.engine.config.runner, llm.engine.config.convert) == ("pooling", "embed")
    got = torch.tensor([out.embedding for out in llm.embed(TEXTS)])
    torch.testing.assert_close(got, reference_embeddings(folder, TEXTS), atol=TOLERANCE, rtol=0)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.scheduler.kv.pool.num_free_blocks == llm.engine.runner.num_kv_blocks  # every block back


def test_matryoshka_dimensions_are_truncated_then_normalised(embedder):
    folder, llm = embedder
    if llm.engine.runner.pooler.config.normalize is False:
        pytest.skip("the mean folder has no Normalize module: a truncated embedding stays as it is")
    got = torch.tensor([out.embedding for out in llm.embed(TEXTS[:3], dimensions=16)])
    expected = torch.nn.functional.normalize(reference_embeddings(folder, TEXTS[:3])[:, :16], dim=1)
    torch.testing.assert_close(got, expected, atol=TOLERANCE, rtol=0)


def test_input_over_the_context_is_refused_or_truncated(embedder):
    folder, llm = embedder
    long_text = words(99, 300)  # the tiny model's context is 256 tokens
    with pytest.raises(InvalidRequestError) as refused:
        llm.embed([TEXTS[0], long_text])
    assert refused.value.param == "input" and "truncate_prompt_tokens" in str(refused.value)
    assert not llm.engine.has_unfinished_requests()  # all or none: the short one was never admitted
    got = torch.tensor(llm.embed(long_text, truncate_prompt_tokens=40)[0].embedding)
    kept = " ".join(long_text.split()[-40:])
    torch.testing.assert_close(got, reference_embeddings(folder, [kept])[0], atol=TOLERANCE, rtol=0)


def test_embeddings_batched_with_generation_traffic(tmp_path):
    """Pooling and generation requests in the same steps of one engine: each equals its own reference."""
    folder = embedding_folder(tmp_path / "mixed")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder).float().eval()
    hf_model.generation_config.eos_token_id = None
    engine = LLM(str(folder), dtype="float32", max_num_tokens=24, max_batch_size=8, num_kv_blocks=64).engine
    prompts = [[5, 9, 13, 2 + i, 40] for i in range(3)]
    greedy = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    gen_ids = [engine.add_prompt(None, prompt, greedy) for prompt in prompts]
    params = pooling_sampling_params(PoolingTask.EMBED)
    pool_ids = []
    for text in TEXTS:
        ids = engine.tokenizer(text)["input_ids"]
        pool_ids.append(engine.add_request(engine.requests.build(engine.new_request_id(), ids, params)))
    tokens, pooled, mixed_steps = {r: [] for r in gen_ids}, {}, 0
    while engine.has_unfinished_requests():
        deltas = engine.step()
        scheduled = set(engine.scheduler.last_step.scheduled)
        mixed_steps += bool(scheduled & set(gen_ids)) and bool(scheduled & set(pool_ids))
        for delta in deltas:
            if delta.request_id in tokens:
                tokens[delta.request_id] += delta.delta_token_ids
            elif delta.finished:
                pooled[delta.request_id] = delta.pooled
    assert mixed_steps > 0
    for request_id, prompt in zip(gen_ids, prompts):
        assert tokens[request_id] == hf_greedy(hf_model, prompt, 12)
    got = torch.stack([pooled[r] for r in pool_ids])
    torch.testing.assert_close(got, reference_embeddings(folder, TEXTS), atol=TOLERANCE, rtol=0)


@pytest.mark.parametrize("method", ["native", "sdpa", "split"])
def test_embeddings_equal_sentence_transformers_on_every_prefill_attention(tmp_path, monkeypatch, method):
    """The prefill_attention option reaches every step of the engine it is given (a head size the native prefill
    kernel takes; split's threshold moved to 8 rows, so that 16-token chunks take SDPA and the short tails the native
    kernel), and the float32 embeddings equal sentence-transformers' on each; an engine left on auto keeps the
    CPU's choice (native for a float32 pool)."""
    if kernels.load() is None or not kernels.load().prefill_attention_available(32):
        pytest.skip("no native prefill kernel here: every method attends by SDPA")
    monkeypatch.delenv("BATCHSERVE_PREFILL_ATTENTION", raising=False)
    monkeypatch.setattr(paths, "SHORT_PREFILL_MAX_ROWS", 8)
    seen = []
    take_rows = attention.native_prefill_rows
    monkeypatch.setattr(attention, "native_prefill_rows", lambda method: seen.append(method) or take_rows(method))
    attention.preferred_prefill_method.cache_clear()
    folder = embedding_folder(tmp_path / "native", head_dim=32)
    llm = LLM(str(folder), dtype="float32", max_num_tokens=16, max_batch_size=4, prefill_attention=method)
    got = torch.tensor([out.embedding for out in llm.embed(TEXTS)])
    torch.testing.assert_close(got, reference_embeddings(folder, TEXTS), atol=TOLERANCE, rtol=0)
    assert set(seen) == {method}
    seen.clear()
    llm.engine.config.prefill_attention = "auto"  # read at each step
    llm.embed(TEXTS[:2])
    assert set(seen) == {"native"}
    attention.preferred_prefill_method.cache_clear()


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_classifier_scores_and_rerank_order_equal_transformers(tmp_path, family):
    folder = classifier_folder(tmp_path / family, family)
    reference = transformers.AutoModelForSequenceClassification.from_pretrained(folder).float().eval()
    llm = LLM(str(folder), dtype="float32", max_num_tokens=16)
    query, documents = words(1, 6), [words(10 + i, 4 + 5 * i) for i in range(5)]
    expected = []
    with torch.no_grad():
        for document in documents:
            ids = llm.tokenizer(query, document, return_tensors="pt")["input_ids"]  # the pair as one sequence
            expected.append(float(torch.sigmoid(reference(ids).logits[0, 0])))
    assert (llm.engine.config.runner, llm.engine.config.convert) == ("pooling", "classify")
    got = [out.score for out in llm.score(query, documents)]
    assert got == pytest.approx(expected, abs=TOLERANCE)
    assert sorted(range(5), key=lambda i: -got[i]) == sorted(range(5), key=lambda i: -expected[i])
    with pytest.raises(InvalidRequestError) as refused:
        llm.generate("w1 w2")
    assert refused.value.param == "model" and "/v1/score" in str(refused.value)
    with pytest.raises(InvalidRequestError, match="--convert embed"):
        llm.embed("w1 w2")


def test_a_causal_lm_scored_yes_no(tmp_path):
    """--convert classify on a causal LM: sigmoid(logit("yes") - logit("no")) at the pair's last token."""
    model = causal_lm_folder(tmp_path / "reranker", yes_no=True)
    llm = LLM(str(tmp_path / "reranker"), dtype="float32", runner="pooling", convert="classify")
    tokenizer = llm.tokenizer
    query, documents = words(2, 5), [words(20 + i, 3 + 4 * i) for i in range(4)]
    with torch.no_grad():
        expected = []
        for document in documents:
            logits = model(tokenizer(query, document, return_tensors="pt")["input_ids"]).logits[0, -1]
            expected.append(float(torch.softmax(logits[[NO, YES]], dim=0)[1]))
    assert [out.score for out in llm.score(query, documents)] == pytest.approx(expected, abs=TOLERANCE)


def test_a_generation_server_refuses_pooling_and_says_which_to_run(tmp_path):
    folder = embedding_folder(tmp_path / "gen")
    llm = LLM(str(folder), dtype="float32", runner="generate")
    assert llm.engine.config.runner == "generate"
    with pytest.raises(InvalidRequestError, match="--runner pooling") as refused:
        llm.embed("w1 w2")
    assert refused.value.param == "model"
    engine: LLMEngine = llm.engine
    request = engine.requests.build("p", [1, 2], pooling_sampling_params(PoolingTask.EMBED))
    with pytest.raises(InvalidRequestError, match="--runner pooling"):
        engine.add_request(request)  # below the front ends too


@pytest.mark.parametrize("preemption_mode", ["recompute", "swap"])
def test_mean_pooling_survives_preemption(tmp_path, preemption_mode):
    """A pool too small for everything at once: growing generations preempt pooling requests mid-prompt, which
    resume (recomputed from their first position, or swapped back with their partial pool); nothing changes."""
    folder = embedding_folder(tmp_path / "mean", "mean", normalize=False)
    engine = LLM(str(folder), dtype="float32", max_num_tokens=16, max_batch_size=6, num_kv_blocks=7,
                 preemption_mode=preemption_mode, num_swap_blocks=32).engine  # fmt: skip
    greedy = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    gen_ids = [engine.add_prompt(None, [3 + i, 7, 11], greedy) for i in range(2)]
    for _ in range(24):  # the generations hold 2 blocks each when the prompts arrive, and grow to 3
        engine.step()
    texts = [words(50 + i, 40 + 3 * i) for i in range(3)]
    params = pooling_sampling_params(PoolingTask.EMBED)
    pool_ids = [engine.add_request(engine.requests.build(engine.new_request_id(), engine.tokenizer(t)["input_ids"],
                                                         params)) for t in texts]  # fmt: skip
    pooled = {}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            if delta.finished and delta.request_id in pool_ids:
                pooled[delta.request_id] = delta.pooled
    assert engine.scheduler.num_preemptions_total > 0
    got = torch.stack([pooled[r] for r in pool_ids])
    torch.testing.assert_close(got, reference_embeddings(folder, texts), atol=TOLERANCE, rtol=0)
    assert not engine.runner.pooler._partial and gen_ids  # nothing left behind
