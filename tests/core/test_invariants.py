"""Property-based: random admit / grow / finish / abort / preempt sequences keep the block accounting sound."""

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.core.helpers import assert_all_blocks_free, make_request, make_scheduler
from tests.fake_runner import FakeRunner, reference_generation

request_spec = st.tuples(st.integers(1, 24), st.integers(1, 16), st.integers(0, 2), st.booleans())
action = st.one_of(
    st.tuples(st.just("add"), request_spec),
    st.tuples(st.just("step"), st.integers(1, 3)),
    st.tuples(st.just("abort"), st.integers(0, 50)),
)


def check_invariants(scheduler):
    pool = scheduler.kv.pool
    owners: dict[int, int] = {}
    for blocks in scheduler.kv.req_blocks.values():
        assert len({b.block_id for b in blocks}) == len(blocks), "a request holds a block twice"
        for b in blocks:
            owners[b.block_id] = owners.get(b.block_id, 0) + 1
    for b in pool.blocks:
        assert b.ref_count >= 0
        assert b.ref_count == owners.get(b.block_id, 0), "ref count differs from the number of owners"
        assert (b.ref_count == 0) == (b.prev_free is not None), "free queue membership differs from ref count"
    assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_count == 0)
    assert pool.num_cached_free_blocks == sum(1 for b in pool.cached.values() if b.ref_count == 0)
    assert scheduler.stats().num_swapped == sum(1 for r in scheduler.waiting if r.status.value == "swapped")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    actions=st.lists(action, min_size=1, max_size=40),
    policy=st.sampled_from(["max_utilization", "guaranteed_no_evict", "static"]),
    mode=st.sampled_from(["recompute", "swap"]),
    caching=st.booleans(),
    num_blocks=st.integers(8, 24),
)
def test_random_operation_sequences(actions, policy, mode, caching, num_blocks):
    s = make_scheduler(
        num_blocks=num_blocks,
        block_size=4,
        caching=caching,
        host_blocks=16,
        max_num_tokens=16,
        max_batch_size=4,
        scheduler_policy=policy,
        preemption_mode=mode,
    )
    runner = FakeRunner(num_blocks, 4, num_swap_blocks=16)
    shared = [11, 12, 13, 14, 15, 16, 17, 18]
    requests, outputs, aborted = [], {}, set()

    def step():
        out = s.schedule()
        assert out.total_num_scheduled_tokens <= 16 and len(out.num_scheduled_tokens) <= 4  # padding included
        assert all(rid not in s.requests for rid in out.padding_req_ids), "padding is only finished requests"
        for o in s.update_from_output(out, runner.execute(out)):
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        check_invariants(s)

    for kind, arg in actions:
        if kind == "add":
            prompt_len, max_tokens, priority, use_shared = arg
            # worst case must fit the pool, or guaranteed_no_evict could never admit it
            prompt_len = min(prompt_len, num_blocks * 4 - max_tokens - 4)
            prefix = shared[: max(0, prompt_len - 1)] if use_shared else []
            prompt = prefix + [100 + len(requests) * 7 + i for i in range(max(1, prompt_len - len(prefix)))]
            r = make_request(f"r{len(requests)}", prompt=prompt, max_tokens=max_tokens, priority=priority)
            requests.append(r)
            s.add_request(r)
        elif kind == "step":
            for _ in range(arg):
                step()
        elif requests:
            victim = requests[arg % len(requests)]
            if not victim.is_finished:
                aborted.add(victim.request_id)
            s.abort_requests([victim.request_id])
            check_invariants(s)
    for _ in range(2000):
        if not s.has_unfinished_requests():
            break
        step()
    assert not s.has_unfinished_requests()
    for r in requests:
        if r.request_id not in aborted:
            assert outputs[r.request_id] == reference_generation(r.prompt_token_ids, r.sampling_params.max_tokens)
    if policy != "max_utilization":
        assert s.num_preemptions_total == 0
    assert_all_blocks_free(s)
