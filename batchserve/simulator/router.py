"""Which replica gets a request: round-robin, least-loaded, or prefix-aware (the replica that already holds the
longest run of the request's prompt blocks, named by the engine's own block-hash chain: serving/routing.py)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from batchserve.serving.routing import PrefixRoutingPolicy, ReplicaLoad, RoutingConfig, block_hashes

ROUTERS = ("round-robin", "least-loaded", "prefix-aware")


class Loaded(Protocol):
    @property
    def num_unfinished(self) -> int: ...


class RoundRobin:
    def __init__(self, num_replicas: int) -> None:
        self.n, self.next = num_replicas, 0

    def route(self, prompt: Sequence[int], replicas: Sequence[Loaded]) -> int:
        index, self.next = self.next, (self.next + 1) % self.n
        return index


class LeastLoaded:
    """Fewest unfinished requests (queued or running), lowest index on a tie."""

    def __init__(self, num_replicas: int) -> None:
        self.n = num_replicas

    def route(self, prompt: Sequence[int], replicas: Sequence[Loaded]) -> int:
        return min(range(len(replicas)), key=lambda i: (replicas[i].num_unfinished, i))


class PrefixAware:
    """The replica holding the longest run of the prompt's leading blocks, unless it is too busy or holds too little
    of it (batchserve.serving.routing decides, as for the Ray Serve router); else the least-loaded replica. A hot
    prefix may pile up to `balance_slack` more requests on one replica before the fallback spreads it. (SGLang's
    cache-aware router decides the same way.)"""

    def __init__(self, num_replicas: int, block_size: int, capacity_blocks: int, balance_slack: int = 32,
                 min_match: float = 0.5) -> None:  # fmt: skip
        config = RoutingConfig(block_size, min_match, balance_slack, max_kv_usage=1.0, capacity_blocks=capacity_blocks)
        self.block_size = block_size
        self.policy = PrefixRoutingPolicy(config)
        self.fallback = LeastLoaded(num_replicas)

    def matched_blocks(self, replica: int, hashes: list[int]) -> int:
        return self.policy.index.matched_blocks(replica, hashes)

    def route(self, prompt: Sequence[int], replicas: Sequence[Loaded]) -> int:
        hashes = block_hashes(prompt, self.block_size)
        loads = {i: ReplicaLoad(queue_len=r.num_unfinished) for i, r in enumerate(replicas)}
        choice = self.policy.choose(hashes, loads)
        chosen = choice.replica if choice.replica is not None else self.fallback.route(prompt, replicas)
        self.policy.routed(chosen, hashes)
        return int(chosen)


def make_router(
    name: str, num_replicas: int, block_size: int, capacity_blocks: int
) -> RoundRobin | LeastLoaded | PrefixAware:
    if name == "round-robin":
        return RoundRobin(num_replicas)
    if name == "least-loaded":
        return LeastLoaded(num_replicas)
    if name == "prefix-aware":
        return PrefixAware(num_replicas, block_size, capacity_blocks)
    raise ValueError(f"router must be one of {', '.join(ROUTERS)}, not {name!r}")
