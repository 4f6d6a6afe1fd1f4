"""The whole engine on a real (tiny, random) Llama checkpoint: greedy output equals transformers' token for token,
whatever the batch composition, chunking, preemption, prefix-cache hits, policy or order."""

from __future__ import annotations

import random

import pytest

from batchserve.engine.llm_engine import LLMEngine
from batchserve.sampling_params import InvalidRequestError, SamplingParams
from tests.doubles import run_to_completion
from tests.tiny_models import VOCAB, hf_greedy, tiny_checkpoint

GREEDY = dict(temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "llama", "tiny_llama")


def workload(count=32, seed=0, shared_prefix=0):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, VOCAB) for _ in range(shared_prefix)]
    lengths = [rng.choice([1, 2, 5, 17, 40, 90, 150]) for _ in range(count)]
    return [(prefix + [rng.randrange(3, VOCAB) for _ in range(n)], rng.randrange(4, 24)) for n in lengths]


def run(directory, requests, arrive_every=1, **options):
    """Request i is added before step i * arrive_every; returns outputs in request order and the engine."""
    engine = LLMEngine.from_options(
        model=str(directory), device="cpu", dtype="float32", **({"num_kv_blocks": 256} | options)
    )
    outputs, finished, step = {}, 0, 0
    while finished < len(requests):
        assert step < 5000, f"requests unfinished after {step} steps: {engine.last_stats}"
        for i in range(len(requests)):
            if i * arrive_every == step:
                prompt, max_tokens = requests[i]
                engine.add_prompt(str(i), prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
        for out in engine.step():  # deltas: each request's ids gathered here
            outputs.setdefault(int(out.request_id), []).extend(out.delta_token_ids)
            finished += out.finished
        step += 1
    assert engine.scheduler.kv.pool.num_free_blocks == engine.scheduler.kv.pool.num_blocks
    return [outputs[i] for i in range(len(requests))], engine


@pytest.fixture(scope="module")
def reference(tiny):
    """Each request of the workload alone in the engine (max_batch_size=1, no cache reuse)."""
    hf_model, directory = tiny
    requests = workload()
    alone = [run(directory, [r], max_batch_size=1, enable_prefix_caching=False)[0][0] for r in requests]
    return requests, alone


def test_greedy_equals_transformers(tiny, reference):
    hf_model, _ = tiny
    requests, alone = reference
    for (prompt, max_tokens), ours in list(zip(requests, alone))[:8]:
        assert ours == hf_greedy(hf_model, prompt, max_tokens)


def test_same_tokens_alone_and_in_a_staggered_batch_of_32(tiny, reference):
    requests, alone = reference
    mixed, engine = run(tiny[1], requests, arrive_every=2, max_batch_size=32, max_num_tokens=48)
    assert mixed == alone
    assert engine.num_steps > 0


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_identical_with_a_pool_so_small_that_preemption_happens_often(tiny, reference, mode):
    requests, alone = reference
    mixed, engine = run(
        tiny[1],
        requests,
        num_kv_blocks=36,
        block_size=8,
        max_batch_size=32,
        max_num_tokens=64,
        preemption_mode=mode,
        num_swap_blocks=64,
    )
    assert mixed == alone
    assert engine.scheduler.num_preemptions_total >= 5


@pytest.mark.parametrize("policy", ["max_utilization", "guaranteed_no_evict", "static"])
@pytest.mark.parametrize("order", ["fcfs", "priority", "shortest_first"])
def test_identical_under_every_policy_and_order(tiny, reference, policy, order):
    requests, alone = reference
    mixed, _ = run(
        tiny[1],
        requests,
        arrive_every=0,
        scheduler_policy=policy,
        scheduling_order=order,
        max_batch_size=12,
        max_num_tokens=64,
        num_kv_blocks=120,
        block_size=8,
    )
    assert mixed == alone


def test_prefix_caching_on_and_off_identical_and_hits(tiny):
    hf_model, directory = tiny
    requests = workload(count=12, seed=1, shared_prefix=40)
    on, engine_on = run(directory, requests, enable_prefix_caching=True, block_size=8)
    off, engine_off = run(directory, requests, enable_prefix_caching=False, block_size=8)
    assert on == off
    assert engine_on.last_stats.prefix_cache_hit_rate > 0.3 and engine_off.last_stats.prefix_cache_hits == 0
    assert on[3] == hf_greedy(hf_model, *requests[3])


def test_static_padding_shares_prefix_blocks_and_matches(tiny):
    """Padded members recompute their last position every step and still hold their blocks; later batches hit
    those blocks in the prefix cache. None of it may change a token."""
    hf_model, directory = tiny
    requests = workload(count=12, seed=2, shared_prefix=24)
    padded, engine = run(directory, requests, arrive_every=0, scheduler_policy="static", max_batch_size=4, block_size=8)
    plain, _ = run(directory, requests, arrive_every=0, enable_prefix_caching=False, block_size=8)
    assert padded == plain
    assert engine.last_stats.prefix_cache_hit_rate > 0.2
    assert padded[5] == hf_greedy(hf_model, *requests[5])


def test_step_timings_cover_the_step(tiny):
    _, directory = tiny
    engine = LLMEngine.from_options(model=str(directory), device="cpu", dtype="float32", num_kv_blocks=64)
    engine.add_prompt("a", [5, 6, 7, 8], SamplingParams(max_tokens=4, **GREEDY))
    coverage = []
    for _ in range(4):  # a prefill and three decodes
        engine.step()
        timings = engine.last_timings
        assert timings.forward_s > 0 and timings.prepare_s > 0 and timings.sample_s > 0
        assert timings.total_s <= engine.last_step_time_s * 1.05 + 1e-4
        coverage.append(timings.total_s / engine.last_step_time_s)
    # A loaded host can preempt the thread between two phases of any one step; it cannot do so in every step.
    assert max(coverage) >= 0.8, coverage


def test_a_padded_request_id_cannot_be_reused_until_its_batch_is_done(tiny):
    _, directory = tiny
    engine = LLMEngine.from_options(
        model=str(directory), device="cpu", dtype="float32", num_kv_blocks=64, scheduler_policy="static"
    )
    engine.add_prompt("a", [5, 6, 7], SamplingParams(max_tokens=1, **GREEDY))
    engine.add_prompt("b", [8, 9, 10], SamplingParams(max_tokens=4, **GREEDY))
    assert any(out.finished for out in engine.step())  # a is done and returned, now padding
    with pytest.raises(InvalidRequestError, match="in use"):
        engine.add_prompt("a", [5, 6, 7], SamplingParams(max_tokens=1, **GREEDY))
    run_to_completion(engine)
    engine.add_prompt("a", [5, 6, 7], SamplingParams(max_tokens=1, **GREEDY))  # free again
    run_to_completion(engine)
    engine.step()
    assert engine.scheduler.kv.pool.num_free_blocks == engine.scheduler.kv.pool.num_blocks
