"""k_policy "cost" (k by load): the step-cost fit, the expected tokens of a verification, and the k that
emits the most tokens per second, from cheap memory-bound steps (draft) to compute-bound ones (no drafts)."""

from __future__ import annotations

import random

import pytest

from batchserve.config import SpeculativeConfig
from batchserve.core.speculation_cost import MIN_OBSERVATIONS, StepCostModel, best_k, expected_tokens
from batchserve.core.speculative import SpeculationPlanner


def test_the_fit_recovers_a_linear_step_cost_and_waits_for_enough_distinct_steps():
    model = StepCostModel()
    for _ in range(MIN_OBSERVATIONS * 2):
        model.observe(16, 0.030)
    assert model.coefficients() is None  # one token count cannot separate the fixed cost from the per-token one
    rng = random.Random(0)
    fresh = StepCostModel()
    for _ in range(MIN_OBSERVATIONS - 1):
        fresh.observe(rng.randint(1, 256), 0.02)
    assert fresh.coefficients() is None  # too few steps yet
    for step in range(400):
        tokens = rng.randint(1, 256)
        cost = 0.010 + 0.0005 * tokens if step >= 200 else 0.030 + 0.0010 * tokens  # the host got faster
        model.observe(tokens, cost)
        fresh.observe(tokens, cost)
    for fit in (model.coefficients(), fresh.coefficients()):  # recent steps weigh most: the old cost has faded
        assert fit[0] == pytest.approx(0.010, rel=0.05) and fit[1] == pytest.approx(0.0005, rel=0.05)


def test_expected_tokens_of_a_verification():
    assert expected_tokens(0.0, 4) == 1.0  # nothing accepted: the target's own token
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_drafts_where_steps_are_memory_bound_and_none_where_tokens_cost_their_share():
    fixed, per_token = 0.010, 0.0011  # about SmolLM2's decode steps on two cores
    assert best_k(1, 0.8, 4, fixed, per_token) == 4
    assert best_k(64, 0.8, 4, fixed, per_token) == 0
    assert best_k(1, 0.0, 4, fixed, per_token) == 0  # drafts never accepted: never worth a token
    ks = [best_k(b, 0.7, 4, fixed, per_token) for b in (1, 2, 4, 8, 16, 32, 64)]
    assert ks == sorted(ks, reverse=True) and ks[0] > ks[-1]  # k falls as the batch grows


def test_the_planner_follows_the_ramp_until_it_has_measured_steps_then_the_cost():
    config = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=64, k_policy="cost")
    planner = SpeculationPlanner(config)
    assert planner.k_for_load(32) == 2  # the ramp: not enough steps measured
    for tokens in range(1, 200, 10):
        planner.observe_step(tokens, 0.010 + 0.0011 * tokens)
    for _ in range(50):
        planner.record(4, 4)  # every draft accepted
    assert planner.acceptance > 0.9
    assert planner.k_for_load(1) == 4 and planner.k_for_load(63) < 4
    for _ in range(200):
        planner.record(4, 0)
    assert planner.k_for_load(1) == 0  # acceptance fell: drafts no longer pay
    assert planner.k_for_load(64) == 0  # disable_by_batch_size still switches speculation off
    ramp = SpeculationPlanner(SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=64))
    for tokens in range(1, 200, 10):
        ramp.observe_step(tokens, 0.010 + 0.0011 * tokens)
    assert ramp.k_for_load(32) == 2  # the default policy ignores the measurements
