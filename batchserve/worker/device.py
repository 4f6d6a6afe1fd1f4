"""Device and dtype resolution (the engine's option strings -> torch objects), and the process-wide torch settings."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path

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


def configure_torch(num_threads: int | None, seed: int) -> None:
    """The process-wide torch settings an entry point chooses, once per process (an engine never sets them: several
    may share one process): intra-op threads (None keeps torch's default), the global RNG seed, and the C heap
    keeping the memory a step frees (keep_freed_memory)."""
    if num_threads:
        torch.set_num_threads(num_threads)
    torch.manual_seed(seed)
    keep_freed_memory()


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD_BYTES = 32 << 20  # the most glibc accepts on 64-bit
TRIM_THRESHOLD_BYTES = 1 << 30


@functools.cache
def keep_freed_memory() -> bool:
    """Keep the memory torch frees in the C heap for the next step instead of handing it back to the kernel.
    torch's CPU tensors come from malloc; with glibc's defaults a large block (a prefill chunk's activations: 2048 x
    3072 bf16 is 12 MB) is mapped afresh and unmapped when freed, or the heap's freed top is trimmed, so the next step
    page-faults the same memory in again, zero-filled by the kernel: ~4,000 faults a 2048-token bf16 prefill step
    (297 -> 257 ms a step without them), 6-10% of peer64's wall time in bf16 (Intel Xeon with AMX; docs/BENCHMARKS.md).
    vLLM's CPU backend gets the same from preloading tcmalloc; here it is two mallopt settings, in-process: blocks up
    to 32 MB come from the heap, and up to 1 GiB of free heap stays mapped. Process-wide and once; True when glibc took
    both (False on another C library, whose defaults stay)."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: setting either fixes both (glibc then stops adapting them)
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1


OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft


def adopt_torch_threads() -> None:
    """Give this thread's OpenMP regions torch's thread count. torch.set_num_threads sets it for the calling thread
    only; a thread started later gets OpenMP's process default instead (OMP_NUM_THREADS, which Ray sets to a
    replica's reserved CPUs, else the core count), and oneDNN's GEMMs follow that: an engine loop thread in a Ray
    replica ran its GEMMs on one thread of two."""
    torch.set_num_threads(torch.get_num_threads())


def release_openmp_workers() -> bool:
    """Let the OpenMP worker threads this thread's parallel regions started go, when this thread will run no more of
    them (it built the engine; another thread steps it). Why it matters: GNU OpenMP counts every thread of every
    thread's team, and once they outnumber the cores (two teams on a 2-core machine) all teams' workers sleep at
    each region's end instead of spinning, so the stepping thread pays a wake-up per operator: 25% of a server's
    decode throughput on 2 cores. True when the runtime let them go; the next parallel region here starts new ones."""
    runtime = openmp_runtime()
    return runtime is not None and runtime.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


@functools.cache
def openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch runs on (its own copy first, else one loaded into the process), or None."""
    libraries = sorted((Path(torch.__file__).parent / "lib").glob("lib*omp*.so*"))
    for library in [*map(str, libraries), None]:
        try:
            runtime = ctypes.CDLL(library)
            runtime.omp_pause_resource_all.argtypes = [ctypes.c_int]
            runtime.omp_get_max_threads.argtypes = []
        except (OSError, AttributeError):
            continue
        return runtime
    return None
