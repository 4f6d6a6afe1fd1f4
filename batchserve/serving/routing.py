"""Prefix- and load-aware choice of a replica, as plain Python (no Ray, no torch): the Ray Serve request router
(batchserve.distributed.router) and the simulator's router both decide with it.

A replica's KV cache can serve a prompt's leading blocks without recomputing them when it holds them. The router
cannot see the caches, so it remembers, per replica, the block hashes of the prompts it sent there (the engine's
own chain, core/block_pool.BlockKey, so a remembered hash names exactly the block the replica's cache would hold),
LRU-bounded as the replica's pool is. A request goes to the replica holding the longest run of its leading blocks,
unless that run is short or that replica is overloaded. A prompt no replica holds goes to the replica remembering
the fewest blocks among those not overloaded: new prefixes spread over the caches instead of piling up where a
coin toss sends them (SGLang's cache-aware router picks its smallest tree the same way). An overloaded best match
leaves the choice to the caller's fallback (power of two choices in Ray, least loaded in the simulator).

A request with a LoRA adapter hashes its blocks under its adapter (the engine never shares K/V across adapters), and
where no prefix decides, it goes to a replica that reports the adapter loaded (ReplicaLoad.adapters) among those not
overloaded: another replica would first read the adapter's folder and may push out one its requests use.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from batchserve.core.block_pool import BlockKey


def block_hashes(prompt: Sequence[int], block_size: int, adapter: str | None = None) -> list[int]:
    """The chain of full-block hashes the KV cache manager computes for this prompt (parent hash, own tokens); under
    an adapter the chain starts from the adapter's name, so that no adapter's blocks match another's."""
    out, parent = [], (None if adapter is None else zlib.crc32(adapter.encode()))
    for i in range(len(prompt) // block_size):
        parent = BlockKey(parent, tuple(prompt[i * block_size : (i + 1) * block_size])).hash
        out.append(parent)
    return out


class Decision(StrEnum):
    PREFIX = "prefix"  # the replica holding the longest match
    NO_MATCH = "no_match"  # no replica holds enough of the prompt: the one remembering the fewest blocks
    ADAPTER = "adapter"  # no prefix decides: a replica with the request's LoRA adapter loaded
    OVERLOADED = "overloaded"  # the best match is too busy: fallback


@dataclass(frozen=True)
class ReplicaLoad:
    """What the router knows of a replica's load: requests queued or running there, its KV pool's usage, and the
    LoRA adapters it holds loaded."""

    queue_len: int = 0
    kv_usage: float = 0.0
    adapters: frozenset[str] = frozenset()


@dataclass(frozen=True)
class RoutingConfig:
    """`min_match`: share of the prompt's full blocks the best replica must hold; `max_imbalance`: how many more
    queued requests than the least loaded replica it may have; `max_kv_usage`: above this share of its pool the
    replica is full (its next admissions would evict or preempt); `capacity_blocks`: hashes remembered per
    replica (about its KV pool's size in blocks)."""

    block_size: int = 16
    min_match: float = 0.5
    max_imbalance: int = 8
    max_kv_usage: float = 0.95
    capacity_blocks: int = 8192


@dataclass(frozen=True)
class Choice:
    replica: Hashable | None  # None: the caller's fallback picks
    decision: Decision
    matched_blocks: int


class PrefixIndex:
    """Per replica, the block hashes last routed there, least recently used first."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self._seen: dict[Hashable, OrderedDict[int, None]] = {}

    def matched_blocks(self, replica: Hashable, hashes: Sequence[int]) -> int:
        """How many of the leading hashes the replica holds (a chain: a hit on block i implies blocks 0..i)."""
        seen = self._seen.get(replica)
        if not seen:
            return 0
        n = 0
        for h in hashes:
            if h not in seen:
                break
            n += 1
        return n

    def record(self, replica: Hashable, hashes: Iterable[int]) -> None:
        seen = self._seen.setdefault(replica, OrderedDict())
        for h in hashes:
            seen[h] = None
            seen.move_to_end(h)
        while len(seen) > self.capacity:
            seen.popitem(last=False)

    def size(self, replica: Hashable) -> int:
        """How many block hashes the replica is remembered to hold."""
        return len(self._seen.get(replica, ()))

    def forget(self, replica: Hashable) -> None:
        """The replica is gone (or restarted with an empty cache)."""
        self._seen.pop(replica, None)

    def replicas(self) -> list[Hashable]:
        return list(self._seen)


class PrefixRoutingPolicy:
    def __init__(self, config: RoutingConfig) -> None:
        self.config = config
        self.index = PrefixIndex(config.capacity_blocks)

    def choose(
        self, hashes: Sequence[int], loads: Mapping[Hashable, ReplicaLoad], adapter: str | None = None
    ) -> Choice:
        """The replica with the longest match among `loads`' keys (ties: the less loaded, then one holding
        `adapter`); where no prefix decides, a replica holding `adapter` (the least loaded), else the replica with the
        most room; None where the caller's fallback should pick."""
        if not loads:
            return Choice(None, Decision.NO_MATCH, 0)
        least_queue = min(load.queue_len for load in loads.values())
        matched = {r: self.index.matched_blocks(r, hashes) for r in loads}
        best = max(loads, key=lambda r: (matched[r], -loads[r].queue_len, adapter in loads[r].adapters))
        if not hashes or matched[best] == 0 or matched[best] < self.config.min_match * len(hashes):
            holder = self._holding(adapter, loads, least_queue)
            if holder is not None:
                return Choice(holder, Decision.ADAPTER, matched[best])
            if not hashes:  # nothing to place by: a prompt shorter than a block
                return Choice(None, Decision.NO_MATCH, 0)
            return Choice(self._roomiest(loads, least_queue), Decision.NO_MATCH, matched[best])
        if self._overloaded(loads[best], least_queue):
            return Choice(None, Decision.OVERLOADED, matched[best])
        return Choice(best, Decision.PREFIX, matched[best])

    def _overloaded(self, load: ReplicaLoad, least_queue: int) -> bool:
        return load.queue_len - least_queue > self.config.max_imbalance or load.kv_usage > self.config.max_kv_usage

    def _holding(self, adapter: str | None, loads: Mapping[Hashable, ReplicaLoad], least_queue: int) -> Hashable | None:
        """Among replicas not overloaded that hold `adapter` loaded, the least loaded (ties: fewest blocks)."""
        if adapter is None:
            return None
        ready = [r for r, load in loads.items() if adapter in load.adapters and not self._overloaded(load, least_queue)]
        return min(ready, key=lambda r: (loads[r].queue_len, self.index.size(r)), default=None)

    def _roomiest(self, loads: Mapping[Hashable, ReplicaLoad], least_queue: int) -> Hashable | None:
        """Among replicas not overloaded, the one remembering the fewest blocks (ties: the shorter queue)."""
        ready = [r for r, load in loads.items() if not self._overloaded(load, least_queue)]
        return min(ready, key=lambda r: (self.index.size(r), loads[r].queue_len), default=None)

    def routed(self, replica: Hashable, hashes: Sequence[int]) -> None:
        """The request went to `replica`, whichever way it was chosen: its blocks are there from now on."""
        self.index.record(replica, hashes)
