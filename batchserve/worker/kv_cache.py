"""The paged KV pool: sizing from the memory budget, per-layer K/V tensors, and the host swap pool."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from batchserve.config import CacheConfig, ConfigError, ModelConfig
from batchserve.host import huge_pages
from batchserve.host.memory import available_memory_bytes
from batchserve.host.memory import block_bytes as _element_block_bytes
from batchserve.layers.kv_quant import CODE_DTYPES, SCALE_DTYPE, QuantizedKV

logger = logging.getLogger(__name__)

GiB = 1024**3
# The CPU default pool stops here (vLLM's CPU default is 4 GiB too): zeroing a larger one costs start-up time, and
# on a host short of memory minutes, for context a CPU cannot compute at a useful speed anyway.
CPU_DEFAULT_MAX_BYTES = 4 * GiB
POOL_ALIGN_BYTES = 64  # where each layer part of the pool starts, as the allocator aligns a tensor of its own


def pool_dtype(cache_config: CacheConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type: kv_cache_dtype, or the model's dtype for "auto"."""
    named = {"bfloat16": torch.bfloat16, "float32": torch.float32, "int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
    return named.get(cache_config.kv_cache_dtype, model_dtype)


def block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V; a quantized pool's scales (one per slot and KV head)
    included."""
    data = _element_block_bytes(model_config, block_size, dtype)
    if dtype not in CODE_DTYPES:
        return data
    scale = torch.empty((), dtype=SCALE_DTYPE).element_size()
    return data + 2 * model_config.num_layers * block_size * model_config.num_kv_heads * scale


def num_blocks_for_budget(
    cache_config: CacheConfig, model_config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> int:
    """num_kv_blocks if given, else the configured fraction of free memory (None: 0.9 on GPU; on CPU 0.25, at most
    CPU_DEFAULT_MAX_BYTES): the most blocks the pool may take (the offline LLM allocates only what its requests
    need, up to this)."""
    per_block = block_bytes(model_config, cache_config.block_size, dtype)
    if cache_config.num_kv_blocks is not None:
        num_blocks = cache_config.num_kv_blocks
    else:
        fraction = cache_config.kv_cache_memory_fraction
        capped = fraction is None and device.type != "cuda"  # only the CPU default is capped, never a chosen value
        if fraction is None:
            fraction = 0.9 if device.type == "cuda" else 0.25
        free = available_memory_bytes(device)
        budget = int(free * fraction)
        num_blocks = (min(budget, CPU_DEFAULT_MAX_BYTES) if capped else budget) // per_block
        if num_blocks < 1:
            raise ConfigError(
                f"no room for a KV block: {free / GiB:.2f} GiB free x {fraction} < {per_block / GiB:.4f} GiB per block"
            )
    return num_blocks


def num_swap_blocks_for_budget(
    cache_config: CacheConfig, model_config: ModelConfig, dtype: torch.dtype, enabled: bool = True
) -> int:
    """num_swap_blocks if given; else from swap_space_gb when swapping is enabled, 0 otherwise."""
    if cache_config.num_swap_blocks is not None:
        return cache_config.num_swap_blocks
    if not enabled:
        return 0
    return int(cache_config.swap_space_gb * GiB) // block_bytes(model_config, cache_config.block_size, dtype)


@dataclass
class KVCache:
    """Per-layer (K, V) pools on the device, plus a host pool of the same layout for swapped-out blocks."""

    device_caches: list[tuple[torch.Tensor, torch.Tensor]]
    host_caches: list[tuple[torch.Tensor, torch.Tensor]]

    @classmethod
    def allocate(
        cls,
        model_config: ModelConfig,
        num_blocks: int,
        num_swap_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> KVCache:
        shape = (block_size, model_config.num_kv_heads, model_config.head_dim)
        device_caches = _zeroed_pool(model_config.num_layers, num_blocks, shape, dtype, device)
        pin = device.type == "cuda"
        if dtype in CODE_DTYPES:
            host = [
                QuantizedKV.zeros((num_swap_blocks, *shape), torch.device("cpu"), pin, dtype) for _ in device_caches
            ]
            return cls(device_caches, host)
        # Only whole swapped-out blocks are ever read back from the host pool, so it may start uninitialised.
        host_caches = [
            (
                torch.empty((num_swap_blocks, *shape), dtype=dtype, pin_memory=pin),
                torch.empty((num_swap_blocks, *shape), dtype=dtype, pin_memory=pin),
            )
            for _ in range(model_config.num_layers)
        ]
        return cls(device_caches, host_caches)

    def resize(self, num_blocks: int, keep_block_ids: Sequence[int] = ()) -> None:
        """A device pool of num_blocks (the host pool stays) in which the blocks `keep_block_ids` keep their K/V, at
        the same ids. Those blocks are set aside compactly and the old pool is freed before the new one is
        allocated: the peak is the new pool plus the kept blocks, never both pools. The other blocks start zeroed."""
        first = self.device_caches[0][0]
        num_layers, shape, dtype, device = len(self.device_caches), tuple(first.shape[1:]), first.dtype, first.device
        del first
        ids = torch.tensor(sorted(keep_block_ids), dtype=torch.long, device=device)
        kept = (
            [tuple(t.index_select(0, ids) for t in _parts(layer)) for layer in self.device_caches] if len(ids) else []
        )
        self.device_caches = []  # nothing holds the old pool now: freed here
        new = _zeroed_pool(num_layers, num_blocks, shape, dtype, device)
        for new_layer, kept_layer in zip(new, kept):
            for new_t, kept_t in zip(_parts(new_layer), kept_layer, strict=True):
                new_t.index_copy_(0, ids, kept_t)
        self.device_caches = new

    @property
    def num_blocks(self) -> int:
        return self.device_caches[0][0].shape[0]

    @property
    def num_swap_blocks(self) -> int:
        return self.host_caches[0][0].shape[0]

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Copy device blocks to host blocks: pairs of (device block id, host block id)."""
        if not pairs:
            return
        src, dst = _index_pair(pairs, self.device_caches[0][0].device)
        for dev, host in zip(self.device_caches, self.host_caches, strict=True):
            for dev_t, host_t in zip(_parts(dev), _parts(host), strict=True):
                host_t.index_copy_(0, dst, dev_t.index_select(0, src).to("cpu"))

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Copy host blocks back to device blocks: pairs of (device block id, host block id)."""
        if not pairs:
            return
        device = self.device_caches[0][0].device
        dst, src = _index_pair(pairs, device)
        for dev, host in zip(self.device_caches, self.host_caches, strict=True):
            for dev_t, host_t in zip(_parts(dev), _parts(host), strict=True):
                dev_t.index_copy_(0, dst, host_t.index_select(0, src).to(device, non_blocking=True))


def _zeroed_pool(
    num_layers: int, num_blocks: int, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    # zeros, not empty: stale NaNs in unwritten slots would leak through masked attention (0 * NaN = NaN).
    if dtype in CODE_DTYPES:
        return [QuantizedKV.zeros((num_blocks, *shape), device, dtype=dtype) for _ in range(num_layers)]
    # One allocation, every layer's K and V a contiguous view of it at a fixed distance from the last: a block's rows
    # of all of them are then one strided array, which the disk tier fills with one copy (worker/kv_offload.py). The
    # distance is rounded up to 64 bytes, so each part starts aligned as a tensor of its own would. On the CPU the
    # allocation lies on 2 MiB pages: each step reads the whole context's K/V once.
    part = num_blocks * torch.Size(shape).numel()
    per_align = max(1, POOL_ALIGN_BYTES // torch.empty((), dtype=dtype).element_size())
    stride = -(-part // per_align) * per_align
    whole = huge_pages.zeros((2 * num_layers, stride), dtype, device)
    views = [whole[i, :part].view(num_blocks, *shape) for i in range(2 * num_layers)]
    return [(views[2 * i], views[2 * i + 1]) for i in range(num_layers)]


def _parts(layer: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The tensors a copy of blocks moves: K and V, and a quantized pool's scales."""
    return layer.parts() if isinstance(layer, QuantizedKV) else tuple(layer)


def _index_pair(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(device ids on the device, host ids on the CPU)."""
    dev_ids = torch.tensor([d for d, _ in pairs], dtype=torch.int64, device=device)
    host_ids = torch.tensor([h for _, h in pairs], dtype=torch.int64)
    return dev_ids, host_ids
