"""Optional native CPU kernels, compiled on first use (torch.utils.cpp_extension, cached on disk).

Never required for correctness: when the compiler or ninja is missing, or BATCHSERVE_NATIVE_KERNELS=0, `load()`
returns None and the torch reference path runs instead.
"""

from __future__ import annotations

import functools
import logging
import platform
from pathlib import Path

import torch

from batchserve import env
from batchserve.layers.kernels.build import build_or_load

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


# The native attention kernels' instruction-set paths by name, best first (kernels.h AttentionPath): bf16 K/V by
# vdpbf16ps (float32 K/V as "avx512"), K/V widened to float32 under AVX-512, K/V widened to float32 in 8-wide AVX2 +
# FMA, the plain loop. A path takes the next one down for what it does not cover (a head size other than 32/64/128
# runs the plain loop); prefill has a kernel on the AVX-512 paths only (on the others the torch code runs).
ATTENTION_PATHS = ("avx512_bf16", "avx512", "avx2", "portable")


def attention_path_runs(path: str) -> bool:
    """Whether the native kernels are built here with the path named `path` and this CPU runs it."""
    native = load()
    if native is None or path not in ATTENTION_PATHS:
        return False
    return native.attention_path_runs(native.AttentionPath.__members__[path])


@functools.cache
def attention_path():
    """The path the native attention kernels take (the module's AttentionPath, handed to every call), chosen once:
    BATCHSERVE_ATTENTION_PATH when set (ValueError when it names no path or one that cannot run here), else the best
    this build and CPU run. Logged once. None where the native kernels are not built."""
    native = load()
    if native is None:
        return None
    name = _chosen_path("native attention path", "BATCHSERVE_ATTENTION_PATH", env.attention_path(), ATTENTION_PATHS,
                        attention_path_runs, native.best_attention_path().name, {"avx512_bf16": " (needs avx512_bf16)"})  # fmt: skip
    return native.AttentionPath.__members__[name]


def _chosen_path(
    what: str, variable: str, forced: str | None, paths: tuple[str, ...], runs, auto: str, needs: dict[str, str]
) -> str:
    """A code path chosen once: `forced` (from `variable`) when set, checked against `paths` and `runs`, else
    `auto`; logged."""
    if forced is not None:
        if forced not in paths:
            raise ValueError(f"{variable}={forced!r}: not one of auto, {', '.join(paths)}")
        if not runs(forced):
            raise ValueError(
                f"{variable}={forced!r}: not built here or not runnable on this CPU{needs.get(forced, '')}"
            )
    path = forced or auto
    logger.info("%s: %s (%s)", what, path, variable if forced else "chosen by the CPU's flags")
    return path


# The GEMM paths of bfloat16 models on a CPU with bf16 matmul units (layers/linear.py CpuLinear), best first: the
# native AMX kernel (amx_gemm.cpp), that kernel's tile operations emulated in scalar code (for tests), oneDNN's packed
# GEMM. The emulated path is never chosen by itself.
GEMM_PATHS = ("amx", "amx_emulated", "onednn")
AMX_PANEL = 32  # output columns per panel of the AMX kernel's packed weights (amx_gemm.cpp kPanel)


def gemm_path_runs(path: str) -> bool:
    """Whether the native kernels are built here with `path` and this CPU runs it."""
    if path == "onednn":
        return True
    native = load()
    if native is None:
        return False
    flags = cpu_flags().split()  # the kernel's epilogue rounds with AVX512-BF16
    return path == "amx_emulated" or ("amx_bf16" in flags and "avx512_bf16" in flags and native.amx_gemm_available())


@functools.cache
def bf16_gemm_path() -> str:
    """The GEMM path of bfloat16 projections on bf16 matmul units, chosen once: BATCHSERVE_GEMM_PATH when set
    (ValueError when it names no path or one that cannot run here), else AMX where the CPU has it. Logged once."""
    auto = "amx" if gemm_path_runs("amx") else "onednn"
    return _chosen_path("bf16 GEMM path", "BATCHSERVE_GEMM_PATH", env.gemm_path(), GEMM_PATHS, gemm_path_runs, auto, {})


# The float32 GEMM paths of decode-sized batches (layers/linear.py CpuLinear), best first: the native small-M kernel
# in AVX-512 or in AVX2 + FMA (small_gemm.cpp; each packs its own panel width), the libraries' GEMMs (oneDNN, x @ W).
SMALL_GEMM_PATHS = ("avx512", "avx2", "library")


def small_gemm_path_runs(path: str) -> bool:
    """Whether the native kernels are built here with `path` (built only where this CPU runs it)."""
    if path == "library":
        return True
    native = load()
    return native is not None and path in native.small_gemm_paths()


@functools.cache
def small_gemm_path() -> str:
    """The float32 GEMM path of decode-sized batches, chosen once: BATCHSERVE_SMALL_GEMM_PATH when set (ValueError
    when it names no path or one that cannot run here), else the best this build runs. Logged once."""
    auto = next(p for p in SMALL_GEMM_PATHS if small_gemm_path_runs(p))
    return _chosen_path(
        "small-M float32 GEMM path",
        "BATCHSERVE_SMALL_GEMM_PATH",
        env.small_gemm_path(),
        SMALL_GEMM_PATHS,
        small_gemm_path_runs,
        auto,
        {},
    )


def for_tensors(*tensors: torch.Tensor, dtypes: tuple[torch.dtype, ...] = (torch.float32,)):
    """The compiled module when the kernels take these tensors (all on the CPU, each in one of `dtypes`) and it is
    built here; else None, and the caller runs its torch code."""
    if all(t.device.type == "cpu" and t.dtype in dtypes for t in tensors):
        return load()
    return None


@functools.cache
def load():
    """The compiled module, or None when native kernels are off (BATCHSERVE_NATIVE_KERNELS=0) or cannot be built
    here. Decided once, as the paths above are (layers ask at every call: a cached answer, not an environment
    lookup); `load.cache_clear()` decides again without building again."""
    return _build() if env.native_kernels() else None


def _build():
    """The module built (or found built under its build key) once per process; None when it cannot be built here."""
    here = Path(__file__).parent
    try:
        return build_or_load(tuple(_SOURCES), tuple(sorted(here.glob("*.h"))), tuple(CFLAGS), cpu_flags())
    except Exception as exc:  # a missing compiler must not stop the engine
        logger.warning("native CPU kernels unavailable (%s); using the torch attention path", exc)
        return None
