"""The memory probes: how much memory the device has free now, and how many bytes a KV block takes. The worker
sizes its KV pool with them; the profiler records them for the simulator."""

from __future__ import annotations

import torch

from batchserve.config import ModelConfig


def block_bytes(model_config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one block takes across all layers, K and V."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * model_config.num_layers * block_size * model_config.num_kv_heads * model_config.head_dim * elem


def available_memory_bytes(device: torch.device) -> int:
    """Memory free now: torch.cuda.mem_get_info on GPU, MemAvailable from /proc/meminfo on CPU."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise RuntimeError("cannot read MemAvailable from /proc/meminfo; set num_kv_blocks explicitly")
