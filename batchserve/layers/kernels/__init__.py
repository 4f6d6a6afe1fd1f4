"""Optional native CPU kernels, compiled on first use (torch.utils.cpp_extension, cached on disk).

Never required for correctness: when the compiler or ninja is missing, or BATCHSERVE_NATIVE_KERNELS=0, `load()`
returns None and the torch reference path runs instead.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import platform
from pathlib import Path

import torch

from batchserve import env

logger = logging.getLogger(__name__)

_SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))


FUSED_DTYPES = (torch.float32, torch.bfloat16)  # what the fused norm, RoPE, SwiGLU and K/V store kernels take

CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp"]


@functools.cache
def cpu_flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them ("flags : fpu vme ..."), else the processor name."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def has_matmul_units(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` natively (AMX or AVX512-BF16 / AVX512-FP16), so that a GEMM in it is
    faster than in float32."""
    forced = env.low_precision_units()
    if forced is not None:
        return forced and dtype in (torch.bfloat16, torch.float16)
    wanted = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")}
    flags = cpu_flags().split()
    return any(flag in flags for flag in wanted.get(dtype, ()))


def _machine_tag() -> str:
    """-march=native code is only valid on the CPU it was built for: key the build on the CPU's flags (and ours)."""
    flags = cpu_flags()
    sources = "".join(p.read_text() for p in (*_SOURCES, *sorted(Path(__file__).parent.glob("*.h"))))
    # the compile command holds torch's include path as this interpreter spells it (a symlinked venv spells it
    # two ways): one build folder per spelling, or each would rebuild the other's objects
    return hashlib.sha1((flags + " ".join(CFLAGS) + sources + torch.__file__).encode()).hexdigest()[:12]


def for_tensors(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)):
    """The compiled module when the kernels take these tensors (all on the CPU, each in one of `dtypes`) and it is
    built here; else None, and the caller runs its torch code."""
    if all(t.device.type == "cpu" and t.dtype in dtypes for t in tensors):
        return load()
    return None


@functools.cache
def load():
    """The compiled module, or None when native kernels are off or cannot be built here."""
    if not env.native_kernels():
        return None
    try:
        from torch.utils.cpp_extension import load as load_extension

        return load_extension(
            name=f"batchserve_cpu_kernels_{_machine_tag()}",
            sources=[str(p) for p in _SOURCES],
            extra_cflags=CFLAGS,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )
    except Exception as exc:  # a missing compiler must not stop the engine
        logger.warning("native CPU kernels unavailable (%s); using the torch attention path", exc)
        return None
