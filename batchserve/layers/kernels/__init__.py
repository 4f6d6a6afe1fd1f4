"""Optional native CPU kernels, compiled on first use (torch.utils.cpp_extension, cached on disk).

Never required for correctness: when the compiler or ninja is missing, or BATCHSERVE_NATIVE_KERNELS=0, `load()`
returns None and the torch reference path runs instead.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
from pathlib import Path

import torch

from batchserve import env
from batchserve.layers.kernels import paths
from batchserve.layers.kernels.build import build_or_load, sources_for
from batchserve.layers.kernels.paths import (
    OPERATIONS,
    KernelPaths,
    built_pairs,
    flag_set,
    select_path,
    select_paths,
    why_not,
)

logger = logging.getLogger(__name__)

_SOURCES = sorted(Path(__file__).parent.glob("*.cpp"))


FUSED_DTYPES = (torch.float32, torch.bfloat16)  # what the fused norm, RoPE, SwiGLU and K/V store kernels take

CFLAGS = ["-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fopenmp", "-Winvalid-pch"]


@functools.cache
def cpu_flags() -> str:
    """The CPU's feature flags as /proc/cpuinfo lists them ("flags : fpu vme ..."), else the processor name."""
    try:
        return next(line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags"))
    except (OSError, StopIteration):
        return platform.processor()


def _cpuinfo_field(name: str) -> str:
    """The first value of field `name` in /proc/cpuinfo ("" where there is none)."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return ""
    for line in lines:
        key, _, value = line.partition(":")
        if key.strip() == name:
            return value.strip()
    return ""


@functools.cache
def avx512_in_halves() -> bool:
    """Whether this CPU runs AVX-512 in two 256-bit halves (paths.avx512_in_halves: AMD family 25), which moves the
    float32 GEMM's row schedule (layers/linear.py CpuLinear)."""
    return paths.avx512_in_halves(_cpuinfo_field("vendor_id"), _cpuinfo_field("cpu family"), cpu_flags())


def has_matmul_units(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` natively (AMX or AVX512-BF16 / AVX512-FP16), so that a GEMM in it is
    faster than in float32."""
    forced = env.low_precision_units()
    if forced is not None:
        return forced and dtype in (torch.bfloat16, torch.float16)
    wanted = {torch.bfloat16: ("amx_bf16", "avx512_bf16"), torch.float16: ("amx_fp16", "avx512_fp16")}
    flags = cpu_flags().split()
    return any(flag in flags for flag in wanted.get(dtype, ()))


# Each operation's paths by name, best first (paths.py OPERATIONS: the kernel table's rules). Attention: bf16 K/V by
# vdpbf16ps (float32 K/V as "avx512"), K/V widened to float32 under AVX-512, 8-wide AVX2 + FMA, the plain loop; a path
# takes the next one down for what it does not cover (a head size other than 32/64/128 runs the plain loop); prefill
# has a kernel on the AVX-512 paths only. bf16 GEMM on bf16 matmul units: the native AMX kernel (amx_gemm.cpp), its
# tile operations emulated in scalar code (tests; never chosen by itself), bf16 pairs by AVX512-BF16 for decode-sized
# rows (bf16_gemm.cpp), oneDNN's packed GEMM. Float32 GEMM of decode-sized M: the native small-M kernel in AVX-512 or
# AVX2 + FMA (small_gemm.cpp), the libraries' GEMMs.
ATTENTION_PATHS = OPERATIONS["attention"].names
GEMM_PATHS = OPERATIONS["bf16_gemm"].names
SMALL_GEMM_PATHS = OPERATIONS["small_gemm"].names
AMX_PANEL = 32  # output columns per panel of the AMX kernel's packed weights (amx_gemm.cpp kPanel)


def built_here() -> frozenset[tuple[str, str]] | None:
    """The kernel table of this build as (operation, instruction set) pairs, less AMX where the kernel does not grant
    this process the tiles; None where the native kernels are not built."""
    native = load()
    return None if native is None else _table_of(native)


@functools.cache
def _table_of(native) -> frozenset[tuple[str, str]]:
    amx_granted = native.cpu_runs(native.Isa.amx)
    return frozenset(row for row in built_pairs(native.kernel_table()) if row[1] != "amx" or amx_granted)


def path_runs(op: str, path: str) -> bool:
    """Whether `path` of operation `op` (paths.py OPERATIONS) is built here and this CPU runs it."""
    return path in OPERATIONS[op].names and why_not(op, path, flag_set(cpu_flags()), built_here()) is None


def chosen_path(op: str) -> str | None:
    """The path operation `op` takes in this process (paths.select_path on this CPU, build and environment):
    ValueError naming the variable where it forces a path that cannot run here. The first choice logs every
    operation's path in one line."""
    _log_paths_once()
    return select_path(op, cpu_flags(), os.environ, built_here())


def kernel_paths() -> KernelPaths:
    """Every operation's path in this process (paths.select_paths)."""
    return select_paths(cpu_flags(), os.environ, built_here())


def attention_path_runs(path: str) -> bool:
    """Whether the native kernels are built here with the attention path named `path` and this CPU runs it."""
    return load() is not None and path_runs("attention", path)


@functools.cache
def attention_path():
    """The path the native attention kernels take (the module's Isa, handed to every call), chosen once:
    BATCHSERVE_ATTENTION_PATH when set (ValueError when it names no path or one that cannot run here), else the best
    this build and CPU run. None where the native kernels are not built."""
    native = load()
    if native is None:
        return None
    return native.Isa.__members__[chosen_path("attention")]


def prefill_kernel_path_runs(path: str) -> bool:
    """Whether the native prefill kernel `path` ("amx", "avx512_bf16", "amx_emulated", "avx512") is built here and this
    CPU runs it."""
    return load() is not None and path_runs("prefill_attention", path)


@functools.cache
def prefill_kernel_path() -> str | None:
    """The native prefill kernel's path for a bfloat16 pool, chosen once: BATCHSERVE_PREFILL_KERNEL_PATH when set
    (ValueError when it names no path or one that cannot run here), else AMX tiles where the CPU grants them, else
    AVX512-BF16 dot products where the CPU has them, else the attention path's vector kernel. None where the native
    kernels are not built."""
    return None if load() is None else chosen_path("prefill_attention")


def prefill_kernel_isa():
    """prefill_kernel_path() as the module's Isa, which paged_prefill_attention and StepAttention take."""
    path = prefill_kernel_path()
    isa = OPERATIONS["prefill_attention"].path(path).isa if path else "avx512"
    return load().Isa.__members__[isa]


def gemm_path_runs(path: str) -> bool:
    """Whether the bf16 GEMM `path` is built here and this CPU runs it."""
    return path_runs("bf16_gemm", path)


@functools.cache
def bf16_gemm_path() -> str:
    """The GEMM path of bfloat16 projections on bf16 matmul units, chosen once: BATCHSERVE_GEMM_PATH when set
    (ValueError when it names no path or one that cannot run here), else AMX where the CPU has it, else the bf16 pairs
    (decode-sized rows) where it has AVX512-BF16, else oneDNN."""
    return chosen_path("bf16_gemm")


def bf16_gemm_on_amx() -> bool:
    """Whether bfloat16 projections take the AMX kernel (its tiles real or emulated)."""
    return bf16_gemm_path() in ("amx", "amx_emulated")


def small_gemm_path_runs(path: str) -> bool:
    """Whether the small-M GEMM `path` is built here (built only where this CPU runs it)."""
    return path_runs("small_gemm", path)


@functools.cache
def small_gemm_path() -> str:
    """The float32 GEMM path of decode-sized batches, chosen once: BATCHSERVE_SMALL_GEMM_PATH when set (ValueError
    when it names no path or one that cannot run here), else the best this build runs."""
    return chosen_path("small_gemm")


def lora_path_runs(path: str) -> bool:
    """Whether the LoRA kernel `path` is built here and this CPU runs it."""
    return load() is not None and path_runs("lora", path)


@functools.cache
def lora_path():
    """The path of the LoRA kernel (the module's Isa, handed to each step's groups), chosen once:
    BATCHSERVE_LORA_PATH when set (ValueError when it names no path or one that cannot run here), else the best this
    build and CPU run. None where the native kernels are not built."""
    native = load()
    if native is None:
        return None
    return native.Isa.__members__[chosen_path("lora")]


@functools.cache
def _log_paths_once() -> None:
    """The one start-up line of every operation's path (a forced path that cannot run is refused later, by the
    operation that asks for it, and said so here)."""
    from batchserve.layers.linear import CpuLinear  # it builds on this module

    try:
        chosen = kernel_paths()
    except ValueError as exc:
        logger.info("native kernel paths: %s", exc)
        return
    small_path = chosen.paths["small_gemm"] or "library"
    pairs = chosen.paths["bf16_gemm"] == "avx512_bf16"
    logger.info(chosen.line(CpuLinear.row_schedule_for(small_path, halves=avx512_in_halves(), pairs=pairs).describe()))


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
        sources = tuple(sources_for(_SOURCES, cpu_flags()))
        return build_or_load(sources, tuple(sorted(here.glob("*.h"))), tuple(CFLAGS), cpu_flags())
    except Exception as exc:  # a missing compiler must not stop the engine
        logger.warning("native CPU kernels unavailable (%s); using the torch attention path", exc)
        return None
