"""The process-wide settings: torch's intra-op threads and seed, glibc's heap thresholds, OpenMP's worker threads.
An entry point makes them once per process (configure_torch); an engine never does, since several may share one
process. Why each exists, with the measurements: docs/cpu-kernels.md."""

from __future__ import annotations

import ctypes
import functools
from pathlib import Path


def configure_torch(num_threads: int | None, seed: int) -> None:
    """The process-wide torch settings an entry point chooses, once per process: intra-op threads (None keeps
    torch's default), the global RNG seed, and the C heap keeping the memory a step frees (keep_freed_memory)."""
    import torch  # here, not above: a front end imports this module (the engine loop's threads) without a model

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
    torch's CPU tensors come from malloc; with glibc's defaults a large block (a prefill chunk's activations) is
    mapped afresh and unmapped when freed, or the heap's freed top is trimmed, so the next step page-faults the same
    memory in again, zero-filled by the kernel. vLLM's CPU backend gets the same from preloading tcmalloc; here it is
    two mallopt settings, in-process: blocks up to 32 MB come from the heap, and up to 1 GiB of free heap stays
    mapped. Process-wide and once; True when glibc took both (False on another C library, whose defaults stay)."""
    try:
        libc = ctypes.CDLL(None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    # the mmap threshold first: setting either fixes both (glibc then stops adapting them)
    return mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1


COMM_BYTES = 15  # the kernel keeps this many bytes of a process's name (TASK_COMM_LEN less its terminator)


def name_process(name: str) -> bool:
    """Give this process a name `ps`, `top` and /proc/PID/comm show (its first 15 bytes), so that a server's processes
    (API server, engine core, body parser, grammar compiler, ranks: all "python" otherwise) can be told apart, by
    an operator and by the soak's per-process memory timeline. Linux only; False where it cannot be set."""
    try:
        Path("/proc/self/comm").write_bytes(name.encode()[:COMM_BYTES])
    except OSError:
        return False
    return True


OMP_PAUSE_SOFT = 1  # OpenMP 5.0's omp_pause_soft


def adopt_torch_threads() -> None:
    """Give this thread's OpenMP regions torch's thread count. torch.set_num_threads sets it for the calling thread
    only; a thread started later gets OpenMP's process default instead (OMP_NUM_THREADS, which Ray sets to a
    replica's reserved CPUs, else the core count), and oneDNN's GEMMs follow that: an engine loop thread in a Ray
    replica ran its GEMMs on one thread of two."""
    import torch

    torch.set_num_threads(torch.get_num_threads())


def release_openmp_workers() -> bool:
    """Let the OpenMP worker threads this thread's parallel regions started go, when this thread will run no more of
    them (it built the engine; another thread steps it). Why it matters: GNU OpenMP counts every thread of every
    thread's team, and once they outnumber the cores (two teams on a 2-core machine) all teams' workers sleep at
    each region's end instead of spinning, so the stepping thread pays a wake-up per operator. True when the runtime
    let them go; the next parallel region here starts new ones."""
    runtime = openmp_runtime()
    return runtime is not None and runtime.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0


@functools.cache
def openmp_runtime() -> ctypes.CDLL | None:
    """The OpenMP runtime torch runs on (its own copy first, else one loaded into the process), or None."""
    import torch

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
