"""Many replicas: the prefix-aware router keeps each shared prefix on one replica (found by the engine's block-hash
chain), round-robin spreads it; the cluster serves every request once."""

from __future__ import annotations

from batchserve.bench.workloads import WorkloadOptions, make_workload
from batchserve.config import EngineConfig
from batchserve.simulator.cluster import Cluster
from batchserve.simulator.engine import SimEngine
from batchserve.simulator.router import block_hashes, make_router
from tests.simulator.helpers import STEP_MODEL


def grouped_requests(tokenizer, groups=3, per_group=12):
    """`groups` system prompts (one workload seed each), requests of the groups interleaved."""
    options = WorkloadOptions(prefix_len=256, input_len=16, output_len=8)  # the opening sentence all share: < half
    by_group = [make_workload("shared-prefix", tokenizer, per_group, seed=g, options=options) for g in range(groups)]
    requests = []
    for i in range(per_group):
        for g, reqs in enumerate(by_group):
            r = reqs[i]
            r.request_id, r.category = f"g{g}-{i}", f"g{g}"
            requests.append(r)
    return requests


def run(router: str, requests, replicas=4):
    config = EngineConfig.from_options(max_batch_size=8, block_size=16)
    engines = [SimEngine(config, STEP_MODEL, 512, 1024) for _ in range(replicas)]
    return Cluster(engines, make_router(router, replicas, 16, 512)).run(requests)


def test_prefix_aware_sends_each_shared_prefix_to_one_replica(tokenizer):
    requests = grouped_requests(tokenizer)
    result = run("prefix-aware", requests)
    homes = {g: {result.assignment[r.request_id] for r in requests if r.category == g} for g in ("g0", "g1", "g2")}
    assert all(len(h) == 1 for h in homes.values()), homes
    assert len(set.union(*homes.values())) == 3, homes  # three prefixes, three replicas: the load is spread too
    spread = run("round-robin", requests)
    rr_homes = {g: {spread.assignment[r.request_id] for r in requests if r.category == g} for g in homes}
    assert all(len(h) == 4 for h in rr_homes.values()), rr_homes
    hits = lambda res: sum(r.num_cached_tokens for r in res.trace.requests)  # noqa: E731
    assert hits(result) > hits(spread)  # each replica computes its prefix once instead of every replica each prefix
    assert all(r.success and r.output_len == 8 for r in result.trace.requests)
    assert sorted(r.request_id for r in result.trace.requests) == sorted(r.request_id for r in requests)


def test_least_loaded_fills_the_idle_replica(tokenizer):
    requests = grouped_requests(tokenizer, groups=1, per_group=8)
    result = run("least-loaded", requests, replicas=2)
    assert result.routed == [4, 4]


def test_block_hashes_are_the_kv_managers_chain():
    from batchserve.core.block_pool import BlockPool
    from batchserve.core.kv_cache_manager import KVCacheManager
    from batchserve.request import Request
    from batchserve.sampling_params import SamplingParams

    prompt = list(range(50))
    kv = KVCacheManager(BlockPool(8), 16)
    req = Request("a", prompt, SamplingParams(max_tokens=1))
    assert kv.allocate(req, 50) is not None
    hashes = block_hashes(prompt, 16)
    assert hashes == [key.hash for key in kv.req_keys["a"]]  # what the pool finds a prefix hit by
    assert hashes == block_hashes(prompt + [99], 16)  # only full blocks count
    assert hashes[:1] == block_hashes(prompt[:16] + [7] * 34, 16)[:1] and hashes[1] != block_hashes([7] * 50, 16)[1]


def test_trace_file_workload_keeps_arrivals_lengths_and_shared_prefixes(tmp_path):
    from batchserve.simulator.trace_file import load_trace

    path = tmp_path / "t.jsonl"
    rows = [
        '{"arrival_s": 10.5, "input_len": 40, "output_len": 5, "prefix_group": "sys", "prefix_len": 32}',
        '{"arrival_s": 10.0, "input_len": 48, "output_len": 7, "prefix_group": "sys", "prefix_len": 32}',
        '{"arrival_s": 12.0, "prompt_token_ids": [1, 2, 3], "output_len": 2}',
    ]
    path.write_text("\n".join(rows) + "\n")
    requests, arrivals = load_trace(path)
    assert arrivals.offsets(3) == [0.0, 0.5, 2.0]  # sorted, from the first arrival
    assert [r.prompt_len for r in requests] == [48, 40, 3] and [r.output_len for r in requests] == [7, 5, 2]
    assert requests[0].prompt_token_ids[:32] == requests[1].prompt_token_ids[:32]
    assert requests[0].prompt_token_ids[32:40] != requests[1].prompt_token_ids[32:40]
    config = EngineConfig.from_options(max_batch_size=4, block_size=16)
    result = Cluster([SimEngine(config, STEP_MODEL, 64, 1024)], make_router("round-robin", 1, 16, 64)).run(
        requests, arrivals
    )
    assert [r.arrival_time for r in result.trace.requests] == [0.0, 0.5, 2.0]
    assert result.trace.requests[1].num_cached_tokens == 32  # the second of the group finds the first's prefix
