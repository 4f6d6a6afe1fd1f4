"""Device and dtype resolution: the engine's option strings -> torch objects. The process-wide torch settings are
batchserve/host/process.py's."""

from __future__ import annotations

import torch

from batchserve.config import ConfigError
from batchserve.layers import kernels

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(name: str | torch.device = "auto") -> torch.device:
    """Resolve "auto" -> cuda when available else cpu; "cuda" without a GPU is an error."""
    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ConfigError("device='cuda' was asked for but torch sees no CUDA device")
        return torch.device(name)
    if name == "cpu":
        return torch.device("cpu")
    raise ConfigError(f"unknown device {name!r}; use 'auto', 'cpu' or 'cuda'")


def resolve_dtype(name: str | torch.dtype, device: torch.device | None = None) -> torch.dtype:
    """A dtype name -> torch.dtype. "auto": bfloat16 where the device multiplies it natively (a CPU with AVX512-BF16
    or AMX, a GPU that supports it), float32 elsewhere."""
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return auto_dtype(device or torch.device("cpu"))
    try:
        return _DTYPES[name]
    except KeyError:
        raise ConfigError(f"unknown dtype {name!r}; use one of auto, float32, bfloat16, float16") from None


def auto_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    return torch.bfloat16 if kernels.has_matmul_units(torch.bfloat16) else torch.float32
