"""Hypothesis state machine over the real scheduler and block manager (driven through the FakeRunner, which reads
every token back through the block tables): add / step / abort in every request state (waiting, running, preempted,
swapped, padding), under every policy and preemption mode, with requests that can never fit among them.

After every rule: the block pool's accounting holds (free + used == total, ref counts == owners, cached-free count),
swapped requests hold host blocks; after every schedule(): nothing waits while the batch is empty (a request that
can never be admitted is ended, not left at the head of the queue for ever)."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from batchserve.request import FinishReason, RequestStatus
from batchserve.sampling_params import InvalidRequestError
from tests.core.helpers import assert_all_blocks_free, make_request, make_scheduler
from tests.core.test_invariants import check_invariants
from tests.fake_runner import FakeRunner, reference_generation

BLOCK_SIZE = 4
MAX_NUM_TOKENS = 16
MAX_BATCH_SIZE = 4


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        policy=st.sampled_from(["max_utilization", "guaranteed_no_evict", "static"]),
        mode=st.sampled_from(["recompute", "swap"]),
        order=st.sampled_from(["fcfs", "priority", "shortest_first"]),
        caching=st.booleans(),
        num_blocks=st.integers(4, 16),
    )
    def build(self, policy, mode, order, caching, num_blocks):
        self.num_blocks = num_blocks
        self.scheduler = make_scheduler(
            num_blocks=num_blocks, block_size=BLOCK_SIZE, caching=caching, host_blocks=8,
            max_num_tokens=MAX_NUM_TOKENS, max_batch_size=MAX_BATCH_SIZE, scheduler_policy=policy,
            preemption_mode=mode, scheduling_order=order,
        )  # fmt: skip
        self.runner = FakeRunner(num_blocks, BLOCK_SIZE, num_swap_blocks=8)
        self.requests = []
        self.outputs: dict[str, list[int]] = {}
        self.ended: dict[str, FinishReason] = {}
        self.aborted: set[str] = set()

    @rule(
        prompt_len=st.integers(1, 80), max_tokens=st.integers(1, 24), priority=st.integers(0, 2), shared=st.booleans()
    )
    def add(self, prompt_len, max_tokens, priority, shared):
        prefix = [11, 12, 13, 14, 15, 16, 17, 18][: prompt_len - 1] if shared else []
        body = [100 + len(self.requests) * 97 + i for i in range(prompt_len - len(prefix))]
        request = make_request(f"r{len(self.requests)}", prompt=prefix + body, max_tokens=max_tokens, priority=priority)
        if prompt_len >= self.num_blocks * BLOCK_SIZE:  # no room for one token in the whole pool
            with pytest.raises(InvalidRequestError, match="the prompt has"):
                self.scheduler.add_request(request)
            return
        self.requests.append(request)
        self.scheduler.add_request(request)

    @rule(steps=st.integers(1, 4))
    def step(self, steps):
        for _ in range(steps):
            self._step()

    @precondition(lambda self: bool(self.requests))
    @rule(index=st.integers(0, 1000))
    def abort(self, index):
        request = self.requests[index % len(self.requests)]
        if not request.is_finished:
            self.aborted.add(request.request_id)
        for out in self.scheduler.abort_requests([request.request_id]):
            self.ended[out.request_id] = out.finish_reason

    def _step(self):
        s = self.scheduler
        scheduled = s.schedule()
        assert s.running or not len(s.waiting), "requests wait while the batch is empty"
        assert scheduled.total_num_scheduled_tokens <= MAX_NUM_TOKENS
        assert len(scheduled.num_scheduled_tokens) <= MAX_BATCH_SIZE
        for out in s.update_from_output(scheduled, self.runner.execute(scheduled)):
            self.outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                self.ended[out.request_id] = out.finish_reason

    @invariant()
    def accounting_holds(self):
        if not hasattr(self, "scheduler"):
            return
        check_invariants(self.scheduler)
        pool = self.scheduler.kv.pool
        assert pool.num_free_blocks + pool.num_used_blocks == pool.num_blocks
        for request in self.scheduler.waiting:
            swapped = request.status == RequestStatus.SWAPPED
            assert swapped == bool(self.scheduler.kv.req_host_blocks.get(request.request_id))

    def teardown(self):
        if not hasattr(self, "scheduler"):
            return
        s = self.scheduler
        for _ in range(3000):
            if not s.has_unfinished_requests():
                break
            self._step()
        assert not s.has_unfinished_requests(), "requests left unfinished"
        self._step()  # the step that releases the last static batch's padding
        capacity = self.num_blocks * BLOCK_SIZE
        for r in self.requests:
            if r.request_id in self.aborted:
                continue
            assert self.ended[r.request_id] != FinishReason.ABORT, f"{r.request_id} fits but was ended unserved"
            expected = reference_generation(r.prompt_token_ids, r.sampling_params.max_tokens)
            produced = self.outputs[r.request_id]
            assert produced == expected[: len(produced)], "wrong tokens: a block table or a shared block is wrong"
            # all of max_tokens, unless the sequence filled the whole pool (its max_model_len)
            assert len(produced) == r.sampling_params.max_tokens or r.num_tokens == capacity
        assert_all_blocks_free(s)


SchedulerMachine.TestCase.settings = settings(
    max_examples=80, stateful_step_count=30, deadline=None, suppress_health_check=list(HealthCheck)
)
test_scheduler_state_machine = SchedulerMachine.TestCase
