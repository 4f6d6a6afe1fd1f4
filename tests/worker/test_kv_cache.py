"""KV pool sizing, zero initialisation, and swap out/in round trips."""

from __future__ import annotations

import gc

import pytest
import torch

from batchserve.config import CacheConfig, ConfigError, ModelConfig
from batchserve.host import huge_pages
from batchserve.worker import kv_cache as kv_module
from batchserve.worker.kv_cache import KVCache, block_bytes, num_blocks_for_budget, num_swap_blocks_for_budget

CONFIG = ModelConfig(
    vocab_size=32,
    hidden_size=16,
    intermediate_size=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=4,
    max_position_embeddings=64,
)
CPU = torch.device("cpu")


def test_block_bytes():
    # 2 (K and V) x 3 layers x 16 tokens x 2 heads x 4 dims x 4 bytes
    assert block_bytes(CONFIG, 16, torch.float32) == 2 * 3 * 16 * 2 * 4 * 4
    assert block_bytes(CONFIG, 16, torch.bfloat16) == 2 * 3 * 16 * 2 * 4 * 2


def test_explicit_num_blocks_wins():
    assert num_blocks_for_budget(CacheConfig(num_kv_blocks=7), CONFIG, torch.float32, CPU) == 7


def test_fraction_of_free_memory(monkeypatch):
    per_block = block_bytes(CONFIG, CacheConfig().block_size, torch.float32)
    monkeypatch.setattr(kv_module, "available_memory_bytes", lambda device: 1000 * per_block)
    assert num_blocks_for_budget(CacheConfig(), CONFIG, torch.float32, CPU) == 250  # CPU default 0.25
    assert num_blocks_for_budget(CacheConfig(kv_cache_memory_fraction=0.5), CONFIG, torch.float32, CPU) == 500
    monkeypatch.setattr(kv_module, "available_memory_bytes", lambda device: per_block)
    with pytest.raises(ConfigError):
        num_blocks_for_budget(CacheConfig(), CONFIG, torch.float32, CPU)


def test_cpu_default_pool_is_capped_but_an_explicit_fraction_is_not(monkeypatch):
    per_block = block_bytes(CONFIG, CacheConfig().block_size, torch.float32)
    monkeypatch.setattr(kv_module, "available_memory_bytes", lambda device: 64 * kv_module.GiB)
    assert num_blocks_for_budget(CacheConfig(), CONFIG, torch.float32, CPU) == 4 * kv_module.GiB // per_block
    explicit = CacheConfig(kv_cache_memory_fraction=0.25)
    assert num_blocks_for_budget(explicit, CONFIG, torch.float32, CPU) == 16 * kv_module.GiB // per_block


def test_available_memory_reads_meminfo():
    assert kv_module.available_memory_bytes(CPU) > 0


def test_swap_blocks_sizing():
    per_block = block_bytes(CONFIG, CacheConfig().block_size, torch.float32)
    assert num_swap_blocks_for_budget(CacheConfig(num_swap_blocks=5), CONFIG, torch.float32) == 5
    assert num_swap_blocks_for_budget(CacheConfig(swap_space_gb=1.0), CONFIG, torch.float32, enabled=False) == 0
    assert num_swap_blocks_for_budget(CacheConfig(swap_space_gb=1.0), CONFIG, torch.float32) == 1024**3 // per_block


def test_pool_is_zeroed_with_the_right_layout():
    cache = KVCache.allocate(CONFIG, num_blocks=6, num_swap_blocks=2, block_size=8, dtype=torch.float32, device=CPU)
    assert len(cache.device_caches) == CONFIG.num_layers
    for k, v in cache.device_caches:
        assert k.shape == v.shape == (6, 8, 2, 4)
        assert not k.any() and not v.any()
    assert cache.num_blocks == 6 and cache.num_swap_blocks == 2


def test_swap_out_then_in_round_trips_block_contents():
    cache = KVCache.allocate(CONFIG, num_blocks=6, num_swap_blocks=4, block_size=8, dtype=torch.float32, device=CPU)
    for k, v in cache.device_caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in cache.device_caches]
    cache.swap_out([(4, 2), (1, 0)])
    for k, v in cache.device_caches:  # the device blocks get reused by someone else
        k.zero_()
        v.zero_()
    cache.swap_in([(0, 2), (5, 0)])
    for (k, v), (k0, v0) in zip(cache.device_caches, before, strict=True):
        assert torch.equal(k[0], k0[4]) and torch.equal(v[0], v0[4])
        assert torch.equal(k[5], k0[1]) and torch.equal(v[5], v0[1])
        assert not k[1:5].any()
    cache.swap_out([])
    cache.swap_in([])


def _advised_bytes() -> int:
    """Bytes of this process's mappings advised MADV_HUGEPAGE (/proc/self/smaps)."""
    total, size = 0, 0
    with open("/proc/self/smaps") as f:
        for line in f:
            if line.startswith("Size:"):
                size = int(line.split()[1]) * 1024
            elif line.startswith("VmFlags:") and "hg" in line.split():
                total += size
    return total


@pytest.mark.usefixtures("huge_pages_on")
def test_a_large_pool_lies_on_huge_pages_and_a_resize_unmaps_the_old_one():
    config = ModelConfig(**{**CONFIG.__dict__, "num_kv_heads": 4, "head_dim": 64})
    gc.collect()
    outside = _advised_bytes()
    cache = KVCache.allocate(config, num_blocks=256, num_swap_blocks=1, block_size=16, dtype=torch.bfloat16, device=CPU)
    k0 = cache.device_caches[0][0]
    assert k0.data_ptr() % huge_pages.HUGE_PAGE_BYTES == 0 and huge_pages.on_huge_pages(k0)
    k0[3].fill_(1.0)
    del k0
    pool_mb = 2 * 3 * 256 * 16 * 4 * 64 * 2 >> 20  # 6 MiB, mapped with one more huge page for the alignment
    assert _advised_bytes() - outside == (pool_mb + 2) << 20
    cache.resize(512, keep_block_ids=[3])
    gc.collect()
    k0 = cache.device_caches[0][0]
    assert cache.num_blocks == 512 and huge_pages.on_huge_pages(k0)
    assert torch.equal(k0[3], torch.ones_like(k0[3])) and not k0[4:].any()
    assert _advised_bytes() - outside == (2 * pool_mb + 2) << 20  # the old pool unmapped
