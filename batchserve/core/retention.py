"""Retention in the scheduler: a request's kv_retention (batchserve/kv_retention.py) onto its blocks, and the blocks
waiting requests will hit kept back from eviction.

Eviction, from the pool (block_pool.RetentionFreeQueue) and from the disk tier (core/kv_tier.py), goes by priority,
then by what waiting requests will need, then least recently used.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable

from batchserve.core.block_pool import BlockKey, BlockPool, KVBlock
from batchserve.core.kv_tier import Retention
from batchserve.core.lora_schedule import first_parent
from batchserve.request import Request

PROTECT_WAITING = 4  # waiting requests, from the head, whose prefix blocks are kept back from eviction


def block_retention(request: Request, index: int, block_size: int) -> Retention:
    """The retention of the request's block `index`, with its expiry as a wall-clock time."""
    config = request.sampling_params.kv_retention
    if config is None:
        return Retention()
    priority, duration = config.block_retention(index * block_size, request.num_prompt_tokens)
    return Retention(priority, time.time() + duration if duration else 0.0)


def retention_of(block_size: int):
    """block_retention for a given block size: what core/kv_offload.KVOffload asks for each block it writes."""
    return lambda request, index: block_retention(request, index, block_size)


def retain(pool: BlockPool, block: KVBlock, request: Request, index: int, block_size: int) -> None:
    """A block the request holds takes its retention (the highest of the requests sharing it wins)."""
    if request.sampling_params.kv_retention is not None:
        retention = block_retention(request, index, block_size)
        pool.retain(block, retention.priority, retention.expires_at)


class WaitingNeeds:
    """The key hashes (pool) and digests (tier) of the first PROTECT_WAITING waiting requests' full prompt blocks,
    computed once per request while it waits: eviction passes over them while it can."""

    def __init__(self) -> None:
        self._hashes: dict[str, list[int]] = {}
        self._protected: frozenset[int] = frozenset()
        self._tier_signature: tuple[int, ...] | None = None

    def update(self, kv, waiting: Iterable[Request]) -> None:
        """Called every step: the sets are rebuilt only when the head of the queue (or a head request's tier chain)
        changed, not at each step of a long queue that stays put."""
        head = list(itertools.islice(waiting, PROTECT_WAITING))
        if [r.request_id for r in head] != list(self._hashes) or kv.pool.free_queue.protected is not self._protected:
            self._hashes = {r.request_id: self._hashes.get(r.request_id) or _key_hashes(r, kv.block_size) for r in head}
            self._protected = frozenset(h for hashes in self._hashes.values() for h in hashes)
            kv.pool.free_queue.protected = self._protected
            self._tier_signature = None  # the tier's set follows the new head too
        if kv.tier is not None:  # the chains its lookups computed (keys are the manager's to build)
            chains = [kv.tier.req_digests.get(r.request_id, ()) for r in head]
            signature = tuple(len(chain) for chain in chains)
            if signature != self._tier_signature:
                self._tier_signature = signature
                kv.tier.store.protected = frozenset(d for chain in chains for d in chain)


def _keys(request: Request, block_size: int) -> list[BlockKey]:
    keys, parent = [], first_parent(request)  # the manager's first parent: salt and adapter
    tokens = request.prompt_token_ids
    for i in range(len(tokens) // block_size):
        key = BlockKey(parent, tuple(tokens[i * block_size : (i + 1) * block_size]))
        keys.append(key)
        parent = key.hash
    return keys


def _key_hashes(request: Request, block_size: int) -> list[int]:
    return [key.hash for key in _keys(request, block_size)]
