"""Build a scheduler from ints and drive it with the fake paged runner (tests/fake_runner.py, the one runner of
the test doubles in tests/doubles.py)."""

from __future__ import annotations

import random

from batchserve.config import CacheConfig, SchedulerConfig
from batchserve.core.build import build_scheduler
from batchserve.core.scheduler import Scheduler
from batchserve.request import Request
from batchserve.sampling_params import SamplingParams
from tests.fake_runner import FakeRunner


def make_scheduler(num_blocks=64, block_size=4, caching=True, host_blocks=0, clock=None, **config) -> Scheduler:
    """The engine's scheduler (core.build), over blocks smaller than an engine allows: 4 tokens fill one fast."""
    cache = CacheConfig(block_size=block_size, enable_prefix_caching=caching)  # not validated: block_size 4 is ours
    kwargs = {"clock": clock} if clock else {}
    return build_scheduler(SchedulerConfig(**config), cache, num_blocks, host_blocks, **kwargs)


def make_request(rid, prompt_len=8, max_tokens=4, prompt=None, priority=0, arrival=0.0, **params) -> Request:
    rng = random.Random(rid)  # deterministic and distinct per id (str hash() is salted per process)
    tokens = prompt if prompt is not None else [rng.randrange(1, 998) for _ in range(prompt_len)]
    return Request(
        rid,
        list(tokens),
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **params),
        priority=priority,
        arrival_time=arrival,
    )


def drive(
    scheduler: Scheduler, runner: FakeRunner, arrivals: dict[int, list[Request]], max_steps=10_000, on_step=None
) -> dict[str, list[int]]:
    """Run until everything finishes; requests in arrivals[i] are added before step i. Returns outputs by id."""
    outputs: dict[str, list[int]] = {}
    last_arrival = max(arrivals, default=0)
    for step in range(max_steps):
        for request in arrivals.get(step, []):
            scheduler.add_request(request)
        if step > last_arrival and not scheduler.has_unfinished_requests():
            return outputs
        scheduled = scheduler.schedule()
        for r in scheduler.running:
            assert scheduler.kv.num_blocks_of(r) * scheduler.kv.block_size >= r.num_computed_tokens
        model_output = runner.execute(scheduled)
        for out in scheduler.update_from_output(scheduled, model_output):
            outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
        if on_step:
            on_step(scheduler, scheduled)
    raise AssertionError(
        f"requests still unfinished after {max_steps} steps: {len(scheduler.running)} running, "
        f"{scheduler.num_waiting} waiting"
    )


def assert_all_blocks_free(scheduler: Scheduler) -> None:
    pool = scheduler.kv.pool
    assert pool.num_free_blocks == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)
    assert not scheduler.kv.req_blocks
    assert scheduler.kv.host_pool.num_free_blocks == scheduler.kv.host_pool.num_blocks
