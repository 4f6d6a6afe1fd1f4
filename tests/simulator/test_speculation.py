"""Speculative decoding in the simulator (simulator/speculation.py): the per-draft chance reproduces a measured
acceptance rate; a simulated run keeps that rate, emits every request's tokens, holds no block afterwards, and at
batch 1 on a step model where a step's fixed cost dominates finishes sooner with speculation than without, by about
the emitted tokens per step; no rate, no simulation."""

from __future__ import annotations

import pytest

from batchserve.config import EngineConfig
from batchserve.sampling_params import SamplingParams
from batchserve.simulator.engine import SimEngine
from batchserve.simulator.speculation import per_draft_acceptance
from tests.simulator.helpers import STEP_MODEL

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 64}


@pytest.mark.parametrize("rate", [0.0, 0.3, 0.65, 1.0])
def test_the_per_draft_chance_reproduces_the_measured_rate(rate):
    chance = per_draft_acceptance(rate, 4)
    assert sum(chance**i for i in range(1, 5)) / 4 == pytest.approx(rate, abs=1e-9)
    with pytest.raises(ValueError, match="0 to 1"):
        per_draft_acceptance(1.5, 4)


def _run(rate: float | None, num_requests: int, max_tokens: int = 64, speculate: bool = True):
    config = EngineConfig.from_options(num_kv_blocks=256, speculative_config=SPEC if speculate else None)
    engine = SimEngine(config, STEP_MODEL, 256, 2048, acceptance_rate=rate)
    for i in range(num_requests):
        engine.add_request(f"r{i}", list(range(10 + i, 40 + i)), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    outputs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                outputs[out.request_id] = len(out.token_ids)
    return engine, outputs


def test_a_simulated_run_keeps_the_measured_rate_and_every_token():
    engine, outputs = _run(0.6, num_requests=8)
    assert outputs == {f"r{i}": 64 for i in range(8)}
    stats = engine.scheduler.speculation.stats
    assert stats.num_proposed > 500 and stats.acceptance_rate == pytest.approx(0.6, abs=0.06), stats
    assert engine.scheduler.kv.pool.num_free_blocks == engine.scheduler.kv.pool.num_blocks


def test_batch_one_finishes_sooner_by_about_the_tokens_per_step():
    plain, _ = _run(None, num_requests=1, speculate=False)
    fast, _ = _run(1.0, num_requests=1)
    assert fast.num_steps < plain.num_steps / 4  # 5 tokens per verification step after the first token
    assert fast.clock() < plain.clock() / 2.5  # a 5-token step costs more than a 1-token one, far less than five


def test_speculation_without_a_rate_is_refused():
    with pytest.raises(ValueError, match="acceptance rate"):
        _run(None, num_requests=1)
