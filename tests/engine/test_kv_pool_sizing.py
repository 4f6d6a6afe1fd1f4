"""The offline LLM's KV pool sized to its requests: one block at load, grown at generate() to the batch's
worst case within the memory budget; an explicit num_kv_blocks or kv_cache_memory_fraction wins; outputs unchanged.

On the FakeRunner (which loses every slot when the pool is reallocated, so a stale prefix-cache hit would change
the tokens) and on a real tiny Llama (the runner's own resize, static padding's scratch block included)."""

from __future__ import annotations

import random

import pytest

from batchserve.config import EngineConfig
from batchserve.core.kv_cache_manager import cdiv
from batchserve.engine.llm_engine import LLMEngine
from batchserve.entrypoints.llm import LLM
from batchserve.sampling_params import SamplingParams
from tests.doubles import LETTERS, reference_generation, run_to_completion
from tests.tiny_models import VOCAB, hf_greedy, tiny_checkpoint

GREEDY = dict(temperature=0.0, ignore_eos=True)


def letter_prompts(lengths, seed=0, prefix=()):
    rng = random.Random(seed)
    return [list(prefix) + [rng.randrange(LETTERS) for _ in range(n)] for n in lengths]


def generate(llm, prompts, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, **GREEDY)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.token_ids for o in outs]


# ---- the engine and the offline API over the FakeRunner ---------------------------------------------------------------


def test_the_pool_grows_at_generate_to_the_worst_case_of_what_can_run_at_once(make_engine):
    engine = make_engine(num_kv_blocks=1, max_kv_blocks=1000, max_batch_size=4)  # 16-token blocks
    assert engine.limits.max_model_len == 256  # the budget's limits, not the one-block pool's
    llm = LLM.from_engine(engine)
    prompts = letter_prompts([3, 10, 20, 40, 5])
    outs = generate(llm, prompts, 8)
    assert outs == [reference_generation(p, 8, LETTERS) for p in prompts]
    # (prompt + 8) in blocks: 1, 2, 2, 3, 1; four run at once at most: 3 + 2 + 2 + 1
    assert engine.runner.resizes == [(8, 0)]
    assert engine.runner.num_kv_blocks == engine.scheduler.kv.pool.num_blocks == 8
    assert engine.effective_config()["num_kv_blocks"] == "8"


def test_the_budget_caps_the_pool_and_outputs_stay_the_same(make_engine):
    engine = make_engine(num_kv_blocks=1, max_kv_blocks=5, max_batch_size=4)
    prompts = letter_prompts([3, 10, 20, 40, 5])
    outs = generate(LLM.from_engine(engine), prompts, 8)
    assert engine.runner.resizes == [(5, 0)] and engine.runner.num_kv_blocks == 5
    assert outs == [reference_generation(p, 8, LETTERS) for p in prompts]


def test_an_explicit_pool_is_never_resized(make_engine):
    engine = make_engine(num_kv_blocks=256)  # the runner's whole budget, as num_kv_blocks or a fraction gives it
    prompts = letter_prompts([3, 40, 100])
    outs = generate(LLM.from_engine(engine), prompts, 20)
    assert engine.runner.resizes == [] and engine.runner.num_kv_blocks == 256
    assert outs == [reference_generation(p, 20, LETTERS) for p in prompts]


def test_a_larger_batch_grows_the_pool_keeping_the_cached_prefixes_and_a_smaller_one_keeps_both(make_engine):
    """Grown between batches, the pool keeps every cached block at its id (the FakeRunner loses every slot it is not
    told to keep, so a stale hit would change the tokens): the next batch hits the prefix the last one left."""
    engine = make_engine(num_kv_blocks=1, max_kv_blocks=1000)
    llm = LLM.from_engine(engine)
    shared = letter_prompts([32], seed=1)[0]  # two full blocks in common
    first = letter_prompts([4, 8], seed=2, prefix=shared)
    assert generate(llm, first, 6) == [reference_generation(p, 6, LETTERS) for p in first]
    cached = engine.scheduler.kv.pool.num_cached_free_blocks
    assert cached >= 2 and engine.scheduler.kv.pool.num_used_blocks == 0
    hits = engine.scheduler.kv.prefix_hits
    second = letter_prompts([4, 8, 30, 60], seed=3, prefix=shared)
    assert generate(llm, second, 6) == [reference_generation(p, 6, LETTERS) for p in second]
    grown = sum(cdiv(len(p) + 6, 16) for p in second)
    assert engine.runner.resizes == [(sum(cdiv(len(p) + 6, 16) for p in first), 0), (grown, cached)]
    assert engine.scheduler.kv.prefix_hits - hits == 32 * len(second)  # every one of them, the first included
    third = letter_prompts([5], seed=4, prefix=shared)
    hits = engine.scheduler.kv.prefix_hits
    assert generate(llm, third, 6) == [reference_generation(third[0], 6, LETTERS)]
    assert engine.runner.num_kv_blocks == grown and engine.scheduler.kv.prefix_hits - hits == 32


def test_the_engine_used_directly_grows_for_each_request_copying_the_blocks_in_use(make_engine):
    engine = make_engine(num_kv_blocks=1, max_kv_blocks=64)
    a, b = letter_prompts([20], seed=5)[0], None
    engine.add_prompt("a", {"prompt_token_ids": a}, SamplingParams(max_tokens=10, **GREEDY))
    assert engine.runner.resizes == [(2, 0)]  # nothing held a block
    earlier = engine.step() + engine.step()
    b = a[:16] + letter_prompts([24], seed=6)[0]  # its first block is a's, cached
    engine.add_prompt("b", {"prompt_token_ids": b}, SamplingParams(max_tokens=30, **GREEDY))
    assert engine.runner.resizes == [(2, 0), (5, 2)]  # a holds two blocks: kept
    done = run_to_completion(engine, earlier=earlier)
    assert done["a"].token_ids == reference_generation(a, 10, LETTERS)
    assert done["b"].token_ids == reference_generation(b, 30, LETTERS)
    assert done["b"].metrics.num_cached_tokens == 16


# ---- LLM(...) on a real tiny model: the runner's own pool ------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_checkpoint(tmp_path_factory, "llama", "tiny_llama_pool")


def real_prompts(lengths, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(n)] for n in lengths]


def test_offline_llm_sizes_its_pool_to_the_requests_unless_told(tiny):
    hf_model, directory = tiny
    prompts = real_prompts([3, 17, 40, 90])
    lazy = LLM(str(directory), device="cpu", dtype="float32")
    runner = lazy.engine.runner
    assert runner.num_kv_blocks == 1 and runner.max_kv_blocks > 1000  # the default budget, not allocated
    assert lazy.engine.limits.max_model_len == 256  # the model's context
    outs = generate(lazy, prompts, 12)
    assert runner.num_kv_blocks == sum(cdiv(len(p) + 12, 16) for p in prompts) == 14
    assert runner.kv_cache.num_blocks == 15  # and static batching's scratch block

    fixed = LLM(str(directory), device="cpu", dtype="float32", num_kv_blocks=256)
    assert fixed.engine.runner.num_kv_blocks == fixed.engine.runner.max_kv_blocks == 256
    assert generate(fixed, prompts, 12) == outs and fixed.engine.runner.num_kv_blocks == 256
    assert outs[2] == hf_greedy(hf_model, prompts[2], 12)

    budget = LLM(str(directory), device="cpu", dtype="float32", kv_cache_memory_fraction=0.001)
    assert budget.engine.runner.num_kv_blocks == budget.engine.runner.max_kv_blocks > 1  # allocated at load


@pytest.mark.parametrize("policy", ["max_utilization", "static"])
def test_a_real_pool_grown_while_requests_run_keeps_their_kv(tiny, policy):
    """Requests arrive while others run, so the runner's pool grows by copying, and static padding's scratch block
    moves to the new end: the tokens are those of a fixed pool."""
    _, directory = tiny
    requests = list(zip(real_prompts([5, 30, 12, 60, 8, 45], seed=1), [6, 20, 9, 14, 30, 5]))

    def run(initial_kv_blocks):
        config = EngineConfig.from_options(
            model=str(directory), device="cpu", dtype="float32", block_size=8, max_batch_size=3,
            scheduler_policy=policy, **({} if initial_kv_blocks else {"num_kv_blocks": 256}),
        )  # fmt: skip
        engine = LLMEngine(config, initial_kv_blocks=initial_kv_blocks)
        outputs, finished, step = {}, 0, 0
        while finished < len(requests):
            assert step < 2000, engine.last_stats
            if step < len(requests):
                prompt, max_tokens = requests[step]
                engine.add_prompt(str(step), prompt, SamplingParams(max_tokens=max_tokens, **GREEDY))
            for o in engine.step():  # deltas: each request's ids gathered here
                outputs.setdefault(int(o.request_id), []).extend(o.delta_token_ids)
                finished += o.finished
            step += 1
        return [outputs[i] for i in range(len(requests))], engine

    grown, engine = run(initial_kv_blocks=1)
    fixed, _ = run(initial_kv_blocks=None)
    assert grown == fixed
    assert engine.runner.num_kv_blocks == max(cdiv(len(p) + m, 8) for p, m in requests) < 256


def test_a_real_pool_grown_for_a_longer_request_still_hits_the_prompt_cached_before(tiny):
    """The same prompt asked again with a larger max_tokens grows the offline pool: its cached blocks are kept (not
    prefilled anew), and the tokens are those of a fixed pool."""
    hf_model, directory = tiny
    prompt = real_prompts([100], seed=7)[0]
    llm = LLM(str(directory), device="cpu", dtype="float32", block_size=16)
    short = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, **GREEDY), use_tqdm=False)
    blocks_before = llm.engine.runner.num_kv_blocks
    params = SamplingParams(max_tokens=60, **GREEDY)
    [longer] = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert llm.engine.runner.num_kv_blocks > blocks_before  # the pool grew between the two
    assert longer.metrics.num_cached_tokens == 96  # the prompt's six full blocks, not recomputed
    assert longer.token_ids[:2] == short[0].token_ids
    assert longer.token_ids == hf_greedy(hf_model, prompt, 60)
