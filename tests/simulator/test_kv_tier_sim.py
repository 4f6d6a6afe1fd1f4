"""The disk tier in the simulator: the real scheduler over a simulated tier finds a multi-turn chat's histories that
the pool let go, and the first turns after the pool's eviction cost read time instead of prefill time."""

from __future__ import annotations

import random

from batchserve.config import EngineConfig
from batchserve.sampling_params import SamplingParams
from batchserve.simulator.engine import SimEngine
from batchserve.simulator.kv_tier import attach_sim_tier
from tests.simulator.helpers import STEP_MODEL


def chat(engine: SimEngine, conversations=6, turns=4) -> tuple[int, float]:
    """Round-robin turns, each request alone; (prompt tokens served from a cache, virtual seconds)."""
    rng = random.Random(0)
    histories = [[rng.randrange(3, 900) for _ in range(64)] for _ in range(conversations)]
    cached, start = 0, engine.clock()
    for turn in range(turns):
        for n, history in enumerate(histories):
            history += [rng.randrange(3, 900) for _ in range(32)]
            engine.add_request(f"{turn}-{n}", history, SamplingParams(max_tokens=4, ignore_eos=True))
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        cached += out.metrics.num_cached_tokens
            history += [0] * 4
    return cached, engine.clock() - start


def test_the_tier_serves_what_the_pool_let_go():
    config = EngineConfig.from_options(max_batch_size=4, block_size=16)
    plain = SimEngine(config, STEP_MODEL, 16, 1024)
    tiered = SimEngine(config, STEP_MODEL, 16, 1024)
    tier = attach_sim_tier(tiered.scheduler, max_blocks=10_000, read_s_per_block=1e-5)
    cached_plain, seconds_plain = chat(plain)
    cached_tiered, seconds_tiered = chat(tiered)
    assert cached_plain == 0  # 16 blocks hold one conversation: round-robin never finds its history in the pool
    assert tier.stats.hits > 0 and cached_tiered >= tier.stats.hits * 16
    assert seconds_tiered < seconds_plain


def test_a_small_tier_evicts_and_hits_less():
    config = EngineConfig.from_options(max_batch_size=4, block_size=16)
    large, small = SimEngine(config, STEP_MODEL, 16, 1024), SimEngine(config, STEP_MODEL, 16, 1024)
    large_tier = attach_sim_tier(large.scheduler, 10_000, 1e-5)
    small_tier = attach_sim_tier(small.scheduler, 12, 1e-5)
    chat(large), chat(small)
    assert small_tier.stats.evicted > 0 and small_tier.stats.hits < large_tier.stats.hits
