"""The scheduler's hypothesis state machine (tests/core/test_stateful.py) with speculation on: decode sequences carry
drafts, a runner verifies them against what it reads back through the block tables, and rejected drafts are rolled
back. After every rule the pool's accounting holds (no block leaked, none freed twice: ref counts == owners), and at
the end every request's tokens equal the reference generation and every block is free."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize

from batchserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from batchserve.core.build import build_scheduler
from batchserve.core.outputs import ModelOutput, SchedulerOutput
from tests.core.test_stateful import BLOCK_SIZE, MAX_BATCH_SIZE, MAX_NUM_TOKENS, SchedulerMachine
from tests.fake_runner import FakeRunner, reference_next_token


class GuessingProposer:
    """Proposals with a right prefix of random length, then wrong tokens: every acceptance length occurs."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def propose(self, tokens, k):
        tokens, drafts = list(tokens), []
        right = self.rng.randint(0, k)
        for i in range(self.rng.randint(0, k)):
            token = reference_next_token(tokens + drafts, 1000)
            drafts.append(token if i < right else (token + 1) % 1000)
        return drafts


class SpeculativeFakeRunner(FakeRunner):
    """FakeRunner whose speculated requests are verified: the drafts' K/V is written like any token's, each position's
    reference token is computed from the cache read back, drafts are accepted while they equal it, and the table
    drops the blocks past the accepted tokens as the scheduler does."""

    def execute(self, out: SchedulerOutput) -> ModelOutput:
        drafts = out.spec_token_ids
        for rid, tokens in drafts.items():
            self.tokens[rid] += tokens  # the FakeRunner computes scheduled tokens that it knows
        plain = super().execute(out)
        result = ModelOutput()
        for rid, token in zip(plain.req_ids, plain.sampled_token_ids):
            if rid not in drafts:
                result.req_ids.append(rid)
                result.sampled_token_ids.append(token)
        for rid, proposal in drafts.items():
            result.req_ids.append(rid)
            accepted, token = self._verify(rid, proposal)
            result.sampled_token_ids.append(token)
            result.accepted_token_ids[rid] = accepted
        return result

    def _verify(self, rid: str, proposal: list[int]) -> tuple[list[int], int]:
        tokens, table, bs = self.tokens[rid], self.tables[rid], self.block_size
        tokens.pop()  # the plain runner's token after the last draft: recomputed below
        known = len(tokens) - len(proposal)
        seen = [self.cache[table[p // bs] * bs + p % bs] for p in range(len(tokens))]
        accepted = []
        for j, draft in enumerate(proposal):
            if reference_next_token(seen[: known + j], self.vocab_size) != draft:
                break
            accepted.append(draft)
        token = reference_next_token(seen[: known + len(accepted)], self.vocab_size)
        del tokens[known + len(accepted) :]
        tokens.append(token)
        computed = len(tokens) - 1
        del table[-(-computed // bs) :]
        return accepted, token


class SpeculativeSchedulerMachine(SchedulerMachine):
    @initialize(
        policy=st.sampled_from(["max_utilization", "guaranteed_no_evict"]),
        mode=st.sampled_from(["recompute", "swap"]),
        order=st.sampled_from(["fcfs", "priority", "shortest_first"]),
        caching=st.booleans(),
        num_blocks=st.integers(4, 16),
        k=st.integers(1, 5),
        seed=st.integers(0, 1000),
    )
    def build(self, policy, mode, order, caching, num_blocks, k, seed):
        super().build(policy, mode, order, caching, num_blocks)
        config = SchedulerConfig(
            max_num_tokens=MAX_NUM_TOKENS, max_batch_size=MAX_BATCH_SIZE, scheduler_policy=policy,
            preemption_mode=mode, scheduling_order=order,
        )  # fmt: skip
        cache = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=caching)
        speculative = SpeculativeConfig(num_speculative_tokens=k, disable_by_batch_size=MAX_BATCH_SIZE + 1)
        self.scheduler = build_scheduler(config, cache, num_blocks, 8, speculative=speculative)
        self.scheduler.speculation.proposer = GuessingProposer(seed)
        self.runner = SpeculativeFakeRunner(num_blocks, BLOCK_SIZE, num_swap_blocks=8)


SpeculativeSchedulerMachine.TestCase.settings = settings(
    max_examples=60, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)
test_speculative_scheduler_state_machine = SpeculativeSchedulerMachine.TestCase
