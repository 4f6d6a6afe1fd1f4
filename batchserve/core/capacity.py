"""Whether a request's blocks fit, by policy: the worst-case reservation of guaranteed_no_evict and static, and the
thrash guard's pinned requests (core/scheduler.py asks before it admits or resumes one)."""

from __future__ import annotations

from collections.abc import Sequence

from batchserve.config import SchedulerConfig, SchedulerPolicy
from batchserve.core.kv_cache_manager import KVCacheManager, PrefixHit
from batchserve.request import Request


class CapacityPolicy:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv

    def is_pinned(self, request: Request) -> bool:
        """Preempted max_preemptions_per_request times: never chosen again."""
        limit = self.config.max_preemptions_per_request
        return limit is not None and request.num_preemptions >= limit

    def worst_case_blocks(self, request: Request, max_model_len: int) -> int:
        """All its blocks, or with a sliding window the most it holds at once (kv.max_live_blocks)."""
        return self.kv.max_live_blocks(min(request.max_total_tokens, max_model_len), self.config.max_num_tokens)

    def reservation_fits(
        self, request: Request, hit: PrefixHit, running: Sequence[Request], max_model_len: int
    ) -> bool:
        """guaranteed_no_evict and static: the newcomer's worst case plus every running request's remaining
        worst case must fit in the free blocks, so no running request can ever run out."""
        if self.config.scheduler_policy == SchedulerPolicy.MAX_UTILIZATION:
            return True
        reserved = sum(self.worst_case_blocks(r, max_model_len) - self.kv.num_blocks_of(r) for r in running)
        shared = sum(1 for b in hit.blocks if b.ref_count > 0)  # already owned: costs no free block
        held = self.kv.num_blocks_of(request)  # a prefix read back from the disk tier: taken before admission
        return self.worst_case_blocks(request, max_model_len) - held - shared + reserved <= self.kv.pool.num_free_blocks

    def admits(self, request: Request, hit: PrefixHit, running: Sequence[Request], max_model_len: int) -> bool:
        """Both worst-case rules let the newcomer in: the policy's reservation and the pinned requests' room."""
        return self.reservation_fits(request, hit, running, max_model_len) and self.pinned_fit(
            request, running, max_model_len
        )

    def pinned_fit(self, request: Request, running: Sequence[Request], max_model_len: int) -> bool:
        """A pinned request is let in only when every pinned request's worst case fits in the blocks that are free
        or held by requests that may still be preempted: a pinned request never has to wait for blocks for ever."""
        if not self.is_pinned(request):
            return True
        pinned = [r for r in running if self.is_pinned(r)] + [request]
        need = sum(self.worst_case_blocks(r, max_model_len) - self.kv.num_blocks_of(r) for r in pinned)
        yielding = sum(self.kv.num_blocks_of(r) for r in running if not self.is_pinned(r))
        return need <= self.kv.pool.num_free_blocks + yielding
