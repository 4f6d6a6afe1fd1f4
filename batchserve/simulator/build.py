"""From an engine configuration and a profile to simulated replicas sized as the real engine would size itself."""

from __future__ import annotations

from batchserve.config import EngineConfig
from batchserve.simulator.clock import VirtualClock
from batchserve.simulator.cluster import Cluster
from batchserve.simulator.engine import SimEngine
from batchserve.simulator.profile_file import Profile
from batchserve.simulator.router import make_router

GiB = 1024**3


def pool_sizes(config: EngineConfig, profile: Profile) -> tuple[int, int]:
    """(KV blocks, swap blocks): explicit options win; otherwise the profile's memory, as worker/kv_cache.py."""
    cache = config.cache
    blocks = cache.num_kv_blocks or profile.num_kv_blocks(cache.block_size, cache.kv_cache_memory_fraction)
    if cache.num_swap_blocks is not None:
        swap = cache.num_swap_blocks
    elif config.scheduler.preemption_mode == "swap":
        swap = int(cache.swap_space_gb * GiB) // (profile.kv_bytes_per_token * cache.block_size)
    else:
        swap = 0
    return blocks, swap


def make_engine(config: EngineConfig, profile: Profile, acceptance_rate: float | None = None) -> SimEngine:
    blocks, swap = pool_sizes(config, profile)
    return SimEngine(config, profile.step_model, blocks, profile.max_model_len, VirtualClock(), swap, acceptance_rate)


def make_cluster(config: EngineConfig, profile: Profile, replicas: int = 1, router: str = "round-robin",
                 acceptance_rate: float | None = None, lora_adapters: int = 0) -> Cluster:  # fmt: skip
    """`lora_adapters`: the requests spread round-robin over this many LoRA adapters (0: the base model only)."""
    if replicas < 1:
        raise ValueError("replicas must be >= 1")
    engines = [make_engine(config, profile, acceptance_rate) for _ in range(replicas)]
    blocks = engines[0].runner.num_kv_blocks
    cluster = Cluster(engines, make_router(router, replicas, config.cache.block_size, blocks))
    cluster.lora_adapters = lora_adapters
    return cluster
