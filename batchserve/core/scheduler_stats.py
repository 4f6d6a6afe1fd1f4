"""The scheduler's statistics after a step (SchedulerStats): what the engine's metrics and the simulator read."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchserve.core.outputs import SchedulerStats
from batchserve.core.speculative import SpeculationStats

if TYPE_CHECKING:
    from batchserve.core.scheduler import Scheduler


def scheduler_stats(scheduler: Scheduler) -> SchedulerStats:
    """The counts of the last step, the queues and the pool, as `Scheduler.stats()` returns them."""
    step = scheduler.last_step
    pool = scheduler.kv.pool
    scheduled = step.scheduled if step else {}
    spec = scheduler.speculation.stats if scheduler.speculation else SpeculationStats()
    return SchedulerStats(
        spec_num_draft_tokens=spec.num_proposed,
        spec_num_accepted_tokens=spec.num_accepted,
        spec_num_drafts=spec.num_verify_steps,
        spec_num_emitted_tokens=spec.num_emitted,
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_swapped=len(scheduler.kv.req_host_blocks),
        num_preempted_this_step=step.num_preempted if step else 0,
        num_preemptions_total=scheduler.num_preemptions_total,
        slo_num_refused=scheduler.slo.num_refused,
        slo_num_demoted=scheduler.slo.num_demoted,
        slo_num_deadline_dropped=scheduler.slo.num_deadline_dropped,
        num_prefill_tokens=step.num_prefill_tokens if step else 0,
        num_decode_tokens=sum(n for n, prefill in scheduled.values() if not prefill),
        num_scheduled_seqs=len(scheduled),
        max_batch_size=scheduler.config.max_batch_size,
        kv_blocks_total=pool.num_blocks,
        kv_blocks_used=pool.num_used_blocks,
        kv_blocks_cached_free=pool.num_cached_free_blocks,
        kv_blocks_free=pool.num_free_blocks,
        kv_slots_allocated=sum(scheduler.kv.num_blocks_of(r) for r in scheduler.running) * scheduler.kv.block_size,
        kv_slots_filled=sum(r.num_computed_tokens for r in scheduler.running),
        prefix_cache_queries=scheduler.kv.prefix_queries,
        prefix_cache_hits=scheduler.kv.prefix_hits,
        scheduled=dict(scheduled),
        padding=sorted(step.output.padding_req_ids) if step else [],
    )
