"""The prefix- and load-aware policy (batchserve.serving.routing) that the Ray Serve router and the simulator share."""

from __future__ import annotations

import pytest

from batchserve.core.block_pool import BlockPool
from batchserve.core.kv_cache_manager import KVCacheManager
from batchserve.serving.routing import Decision, PrefixRoutingPolicy, ReplicaLoad, RoutingConfig, block_hashes

IDLE = ReplicaLoad()


def _policy(**overrides) -> PrefixRoutingPolicy:
    return PrefixRoutingPolicy(RoutingConfig(block_size=4, **overrides))


def test_block_hashes_chain_full_blocks_only():
    a = block_hashes(list(range(10)), 4)
    assert len(a) == 2 and a == block_hashes(list(range(11)), 4)
    assert block_hashes([9, 1, 2, 3, 4, 5, 6, 7], 4)[1] != a[1]  # a block's hash depends on every block before it


def test_longest_match_wins_and_is_remembered_per_replica():
    policy = _policy()
    system = block_hashes(list(range(16)), 4)
    assert policy.choose(system, {"a": IDLE, "b": IDLE}).decision == Decision.NO_MATCH
    policy.routed("b", system)
    choice = policy.choose(system + [123], {"a": IDLE, "b": IDLE})
    assert (choice.replica, choice.decision, choice.matched_blocks) == ("b", Decision.PREFIX, 4)
    policy.routed("a", system[:2])
    assert policy.choose(system, {"a": IDLE, "b": IDLE}).replica == "b"  # 4 blocks beat 2


def test_short_match_falls_back():
    policy = _policy(min_match=0.5)
    hashes = block_hashes(list(range(40)), 4)  # 10 blocks
    policy.routed("a", hashes[:4])
    assert policy.choose(hashes, {"a": IDLE, "b": IDLE}).decision == Decision.NO_MATCH  # 4 of 10 < half
    policy.routed("a", hashes[:5])
    assert policy.choose(hashes, {"a": IDLE, "b": IDLE}).decision == Decision.PREFIX


def test_an_overloaded_best_match_falls_back_by_queue_or_kv_usage():
    policy = _policy(max_imbalance=3, max_kv_usage=0.9)
    hashes = block_hashes(list(range(16)), 4)
    policy.routed("a", hashes)
    assert policy.choose(hashes, {"a": ReplicaLoad(queue_len=4), "b": ReplicaLoad(queue_len=1)}).replica == "a"
    busy = policy.choose(hashes, {"a": ReplicaLoad(queue_len=5), "b": ReplicaLoad(queue_len=1)})
    assert (busy.replica, busy.decision) == (None, Decision.OVERLOADED)
    full = policy.choose(hashes, {"a": ReplicaLoad(kv_usage=0.95), "b": IDLE})
    assert (full.replica, full.decision) == (None, Decision.OVERLOADED)


def test_new_prefixes_spread_to_the_replica_remembering_fewest_blocks():
    policy = _policy(max_imbalance=2)
    prefixes = [block_hashes(list(range(p * 100, p * 100 + 16)), 4) for p in range(4)]
    homes = []
    for hashes in prefixes:
        choice = policy.choose(hashes, {"a": IDLE, "b": IDLE})
        assert choice.decision == Decision.NO_MATCH and choice.replica is not None
        policy.routed(choice.replica, hashes)
        homes.append(choice.replica)
    assert sorted(homes) == ["a", "a", "b", "b"]  # two prefixes each, not wherever a coin toss sent them
    unseen = block_hashes(list(range(900, 916)), 4)
    busy = {"a": IDLE, "b": ReplicaLoad(queue_len=3)}  # the roomier replica, overloaded: the other one
    policy.routed("a", unseen[:1])
    assert policy.choose(unseen, busy).replica == "a"
    assert policy.choose([], {"a": IDLE, "b": IDLE}).replica is None  # no full block: the caller's fallback


def test_memory_is_bounded_lru_and_forgotten_with_the_replica():
    policy = _policy(capacity_blocks=4)
    old, new = block_hashes(list(range(16)), 4), block_hashes(list(range(100, 116)), 4)
    policy.routed("a", old)
    policy.routed("a", new[:2])  # evicts the two least recently used: old[0] and old[1]
    assert policy.index.matched_blocks("a", old) == 0 and policy.index.matched_blocks("a", new) == 2
    policy.index.forget("a")
    assert policy.index.matched_blocks("a", new) == 0 and policy.index.replicas() == []


def test_a_remembered_hash_names_the_block_the_engine_caches():
    """The router's hashes are the KV cache manager's: a prompt it calls a 2-block match hits 2 blocks there."""
    from batchserve.request import Request
    from batchserve.sampling_params import SamplingParams

    manager = KVCacheManager(BlockPool(8, True), block_size=4)
    first = Request("r1", list(range(10)), SamplingParams(max_tokens=1))
    manager.allocate(first, 10)
    manager.free(first)
    second = Request("r2", list(range(8)) + [77, 78], SamplingParams(max_tokens=1))
    hit = manager.find_prefix_hit(second)
    policy = _policy()
    policy.routed("a", block_hashes(first.prompt_token_ids, 4))
    assert policy.index.matched_blocks("a", block_hashes(second.prompt_token_ids, 4)) == hit.num_tokens // 4 == 2


@pytest.mark.parametrize("router_name", ["PrefixAwareRouter", "PowerOfTwoRouter"])
def test_both_ray_routers_send_a_subscription_to_the_replica_it_names(router_name):
    """A subscribe call must reach the replica holding its caller's requests, whatever the router's policy."""
    import asyncio
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from batchserve.distributed import router as routers
    from batchserve.distributed.messages import Subscribe

    deployment = DeploymentID("EngineReplica", "batchserve")
    router = getattr(routers, router_name)(deployment_id=deployment, handle_source=DeploymentHandleSource.REPLICA)
    if router_name == "PrefixAwareRouter":
        router.initialize_state(block_size=16)
    replicas = [SimpleNamespace(replica_id=SimpleNamespace(unique_id=name)) for name in ("a", "b", "c")]

    def pending(replica_id: str) -> PendingRequest:
        metadata = RequestMetadata(request_id="s", internal_request_id=f"sub-{replica_id}")
        return PendingRequest(args=[Subscribe("ingress-1", replica_id)], kwargs={}, metadata=metadata)

    async def choose(replica_id: str):
        return await router.choose_replicas(replicas, pending(replica_id))

    for name in ("a", "b", "c", "b"):
        ranks = asyncio.run(choose(name))
        assert [[r.replica_id.unique_id for r in rank] for rank in ranks] == [[name]]
    assert asyncio.run(choose("gone")) == []  # being replaced: no choice, the caller's timeout and errors end it


def test_an_adapters_blocks_never_match_another_adapters_or_the_base_models():
    prompt = list(range(16))
    base, sql, chat = (block_hashes(prompt, 4, adapter) for adapter in (None, "sql", "chat"))
    assert len(set(base) | set(sql) | set(chat)) == 12
    assert sql == block_hashes(prompt, 4, "sql")
    policy = _policy()
    policy.routed("a", sql)
    assert policy.choose(chat, {"a": IDLE, "b": IDLE}).matched_blocks == 0


def test_a_request_with_an_adapter_prefers_a_replica_holding_it_unless_a_prefix_or_load_decides():
    policy = _policy(max_imbalance=2)
    holds_sql = ReplicaLoad(queue_len=1, adapters=frozenset({"sql"}))
    loads = {"a": IDLE, "b": holds_sql, "c": IDLE}
    hashes = block_hashes(list(range(16)), 4, "sql")
    choice = policy.choose(hashes, loads, "sql")
    assert (choice.replica, choice.decision) == ("b", Decision.ADAPTER)
    short = policy.choose([], loads, "sql")  # a prompt shorter than a block: the adapter still places it
    assert (short.replica, short.decision) == ("b", Decision.ADAPTER)
    assert policy.choose(hashes, loads, "chat").decision == Decision.NO_MATCH  # nobody holds it: the roomiest
    assert policy.choose(hashes, loads, "chat").replica in ("a", "c")
    policy.routed("c", hashes)
    assert policy.choose(hashes, loads, "sql").replica == "c"  # its blocks are cached there: the prefix wins
    busy = {**loads, "b": ReplicaLoad(queue_len=3, adapters=frozenset({"sql"}))}
    other = block_hashes(list(range(100, 116)), 4, "sql")
    assert policy.choose(other, busy, "sql").decision == Decision.NO_MATCH  # 3 more than the idle ones: overloaded


def test_the_ray_router_sends_an_adapter_request_to_the_replica_reporting_it_loaded():
    """The replicas' routing stats carry the adapters they hold (ReplicaLoadReport.loras); the router reads them."""
    import asyncio
    from types import SimpleNamespace

    from ray.serve._private.common import DeploymentHandleSource, DeploymentID, RequestMetadata
    from ray.serve.request_router import PendingRequest

    from batchserve.distributed.messages import ReplicaLoadReport, ReplicaRequest
    from batchserve.distributed.router import PrefixAwareRouter
    from batchserve.request import EngineRequest
    from batchserve.sampling_params import SamplingParams

    reports = {"a": ReplicaLoadReport(), "b": ReplicaLoadReport(1, 0, 0.1, ("chat", "sql")), "c": ReplicaLoadReport()}
    replicas = [SimpleNamespace(replica_id=name, routing_stats=r.as_dict()) for name, r in reports.items()]
    assert ReplicaLoadReport.from_dict(replicas[1].routing_stats) == reports["b"]

    def request(n: int, adapter: str | None) -> PendingRequest:
        engine_request = EngineRequest(f"r{n}", list(range(n, n + 12)), SamplingParams(lora_name=adapter))
        metadata = RequestMetadata(request_id=f"r{n}", internal_request_id=f"r{n}")
        return PendingRequest(args=[ReplicaRequest(engine_request, "ingress-1")], kwargs={}, metadata=metadata)

    async def first_ranks() -> list[list[str]]:  # Serve's router and requests take the running loop
        router = PrefixAwareRouter(
            deployment_id=DeploymentID("EngineReplica", "batchserve"), handle_source=DeploymentHandleSource.REPLICA
        )
        router.initialize_state(block_size=4)
        pending = [request(n, "sql") for n in range(4)] + [request(9, None)]
        return [[r.replica_id for r in (await router.choose_replicas(replicas, p))[0]] for p in pending]

    *adapter_requests, base = asyncio.run(first_ranks())
    assert adapter_requests == [["b"]] * 4
    assert "b" not in base  # the base model: the roomiest, not the busier b
