"""Which replica gets a request: round-robin, least-loaded, or prefix-aware (the replica that already holds the
longest run of the request's prompt blocks, named by the engine's own block-hash chain, core/block_pool.BlockKey)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Protocol

from batchserve.core.block_pool import BlockKey

ROUTERS = ("round-robin", "least-loaded", "prefix-aware")


class Loaded(Protocol):
    @property
    def num_unfinished(self) -> int: ...


def block_hashes(prompt: Sequence[int], block_size: int) -> list[int]:
    """The chain of full-block hashes the KV cache manager computes for this prompt (parent hash, own tokens)."""
    out, parent = [], None
    for i in range(len(prompt) // block_size):
        parent = BlockKey(parent, tuple(prompt[i * block_size : (i + 1) * block_size])).hash
        out.append(parent)
    return out


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
    """The replica whose recently routed prompts share the most leading blocks with this one, when they cover at
    least `min_match` of the prompt's full blocks (a short common opening is no reason to go anywhere) and that
    replica is not busier than the least-loaded one by more than `balance_slack` requests (a hot prefix must not
    pile all traffic on one replica); else the least-loaded replica. Each replica remembers the hashes of up to
    `capacity_blocks` blocks, LRU, as its KV pool would. (SGLang's cache-aware router decides the same way.)"""

    def __init__(self, num_replicas: int, block_size: int, capacity_blocks: int, balance_slack: int = 32,
                 min_match: float = 0.5) -> None:  # fmt: skip
        self.block_size, self.capacity, self.slack, self.min_match = (
            block_size,
            capacity_blocks,
            balance_slack,
            min_match,
        )
        self.seen: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(num_replicas)]
        self.fallback = LeastLoaded(num_replicas)

    def matched_blocks(self, replica: int, hashes: list[int]) -> int:
        seen, n = self.seen[replica], 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def route(self, prompt: Sequence[int], replicas: Sequence[Loaded]) -> int:
        hashes = block_hashes(prompt, self.block_size)
        least = self.fallback.route(prompt, replicas)
        best = max(
            range(len(replicas)), key=lambda i: (self.matched_blocks(i, hashes), -replicas[i].num_unfinished, -i)
        )
        too_busy = replicas[best].num_unfinished - replicas[least].num_unfinished > self.slack
        matched = self.matched_blocks(best, hashes)
        chosen = least if too_busy or matched == 0 or matched < self.min_match * len(hashes) else best
        seen = self.seen[chosen]
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)
        return chosen


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
