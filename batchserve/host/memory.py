"""The memory probes: how much memory the device has free now, and how many bytes a KV block takes. The worker
sizes its KV pool with them; the profiler records them for the simulator."""

from __future__ import annotations

import torch

from batchserve.config import ConfigError, ModelConfig


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


GiB = 1024**3


class InsufficientMemoryError(ConfigError, MemoryError):
    """The model's weights plus its smallest KV pool do not fit in the memory the engine may use."""


def require_memory_for(weights_bytes: int, min_kv_bytes: int, available_bytes: int) -> None:
    """Refuse, with the numbers, a model that cannot fit: checked before anything is allocated, so the process
    answers in one line instead of being killed by the OOM killer halfway through loading."""
    if weights_bytes + min_kv_bytes > available_bytes:
        raise InsufficientMemoryError(
            f"model needs {weights_bytes / GiB:.2f} GiB of weights + {min_kv_bytes / GiB:.2f} GiB minimum KV cache; "
            f"{available_bytes / GiB:.2f} GiB available"
        )


def min_kv_blocks(num_kv_blocks: int | None, max_model_len: int | None, block_size: int) -> int:
    """The smallest pool the engine can start with: num_kv_blocks if set, else one request of max_model_len if
    set, else a single block (the default pool is a share of what is left, so it adapts)."""
    if num_kv_blocks is not None:
        return num_kv_blocks
    if max_model_len is not None:
        return -(-max_model_len // block_size)
    return 1
