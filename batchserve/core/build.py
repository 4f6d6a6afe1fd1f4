"""The one assembly of a scheduler over its KV pools, shared by the engine, the simulator and the tests, so that
the three schedule with the same parts wired the same way."""

from __future__ import annotations

import time
from collections.abc import Callable

from batchserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
from batchserve.core.block_pool import BlockPool, HostBlockPool
from batchserve.core.kv_cache_manager import KVCacheManager
from batchserve.core.scheduler import Scheduler
from batchserve.core.slo import StepCost


def build_scheduler(
    config: SchedulerConfig,
    cache: CacheConfig,
    num_kv_blocks: int,
    num_swap_blocks: int = 0,
    max_model_len: int | None = None,
    clock: Callable[[], float] = time.monotonic,
    speculative: SpeculativeConfig | None = None,
    sliding_window: int | None = None,
    long_context_from: int | None = None,
    step_cost: StepCost | None = None,
) -> Scheduler:
    """A Scheduler over a fresh pool of num_kv_blocks device blocks and num_swap_blocks host blocks. The pools' sizes
        are given (the runner's, once it has sized them from memory): `cache` gives the block size and whether prefix
        caching is on. max_model_len None: the scheduler config's, else the pool's capacity (Scheduler). sliding_window:
        the model's, only when every attention layer is windowed (blocks that leave it return to the pool). long_context_from:
        LongRoPE's original context (core/long_context.py). step_cost: the SLO predictions' step-time model (core/slo.py;
    None: fitted online from the steps the engine reports)."""
    pool = BlockPool(num_kv_blocks, cache.enable_prefix_caching)
    kv = KVCacheManager(pool, cache.block_size, HostBlockPool(num_swap_blocks), sliding_window)
    return Scheduler(config, kv, max_model_len, clock, speculative, long_context_from, step_cost)
