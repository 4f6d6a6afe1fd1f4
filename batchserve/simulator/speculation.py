"""Speculative decoding in the simulator, from a measured acceptance rate: no text exists here to propose from, so
every decode the scheduler lets speculate gets k drafts (k as the real planner sets it by load), and each draft is
kept with one probability until the first rejection, the probability that reproduces the measured share of drafts
kept (accepted / proposed, as `batchserve bench` prints it) at that k. The verification tokens are priced by the step
model like any multi-token query; a draft model's own passes are not modelled."""

from __future__ import annotations

import dataclasses
import random

from batchserve.config import SpeculativeConfig


def as_modelled(speculative: SpeculativeConfig) -> SpeculativeConfig:
    """The scheduler's side as the real engine's, with the drafts coming from the simulated runner after each step
    (the path of method draft_model) whatever the method simulated."""
    return dataclasses.replace(speculative, method="draft_model", model=speculative.model or "simulated")


def per_draft_acceptance(rate: float, k: int) -> float:
    """The a with (a + a^2 + ... + a^k) / k == rate: drafts kept in order until the first rejection."""
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"an acceptance rate is a share of drafts kept, 0 to 1: {rate}")
    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        if sum(mid**i for i in range(1, k + 1)) / k < rate:
            low = mid
        else:
            high = mid
    return (low + high) / 2


class DraftAcceptance:
    """How many of a decode's drafts the target keeps, drawn from a seeded generator. The rate is measured at the
    configured k; a shorter draft (k shrunk by load) keeps each token with the same chance."""

    def __init__(self, rate: float, k: int, seed: int = 0) -> None:
        self.rate = rate
        self.chance = per_draft_acceptance(rate, k)
        self._rng = random.Random(seed)

    def draw(self, num_drafts: int) -> int:
        kept = 0
        while kept < num_drafts and self._rng.random() < self.chance:
            kept += 1
        return kept
