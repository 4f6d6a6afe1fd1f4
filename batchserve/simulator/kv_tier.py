"""The disk KV tier on the simulator's virtual clock: core's KVOffload (the same lookups, reads and writes the engine
makes) over an index with no files. A block written is found until the cap evicts it (least recently used; the
retention order is the real store's, core/kv_tier.py); a block read back costs `read_s_per_block` of the step that
loads it, which is what a measured `kv_tier_read_seconds_total / kv_tier_hit_blocks_total` gives. So `tune
--simulate` style questions (how large a tier, what hit rate, what TTFT) are answered with the real scheduler."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from batchserve.core.kv_offload import KVOffload
from batchserve.core.kv_tier import Retention, TierStats


class SimTierStore:
    def __init__(self, max_blocks: int, read_s_per_block: float) -> None:
        self.max_blocks, self.read_s_per_block = max_blocks, read_s_per_block
        self.stats = TierStats()
        self.protected: frozenset[bytes] = frozenset()
        self._blocks: OrderedDict[bytes, None] = OrderedDict()
        self._pending: set[bytes] = set()

    def contains(self, digest: bytes) -> bool:
        return digest in self._blocks

    def claim(self, digest: bytes) -> bool:
        if digest in self._blocks or digest in self._pending:
            return False
        self._pending.add(digest)
        return True

    def release(self, digests: Iterable[bytes]) -> None:
        self._pending.difference_update(digests)

    def put(self, digest: bytes, payload: bytes = b"", retention: Retention | None = None) -> bool:
        self._pending.discard(digest)
        self._blocks[digest] = None
        self._blocks.move_to_end(digest)
        self.stats.blocks_written += 1
        while len(self._blocks) > self.max_blocks:
            self._blocks.popitem(last=False)
            self.stats.evicted += 1
        return True

    def get(self, digest: bytes) -> bytes | None:
        if digest not in self._blocks:
            return None
        self._blocks.move_to_end(digest)
        self.stats.blocks_read += 1
        self.stats.read_s += self.read_s_per_block
        return b""

    def __len__(self) -> int:
        return len(self._blocks)


def attach_sim_tier(scheduler, max_blocks: int, read_s_per_block: float) -> KVOffload:
    """A simulated tier under `scheduler`'s pool (SimEngine's TimedRunner writes its saves and charges its reads)."""
    offload = KVOffload(SimTierStore(max_blocks, read_s_per_block), 1, prefetch=False)  # type: ignore[arg-type]
    scheduler.kv.tier = offload
    return offload
