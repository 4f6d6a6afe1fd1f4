"""What a process's memory is made of, from inside it: glibc's heap (in use, free but kept, mapped apart), Python's
objects, and on request tracemalloc's view. A debug hook, off unless BATCHSERVE_MEMORY_TRACE names a file: then
each batchserve process (API server, engine core, body parser, grammar compiler, ranks) appends one JSON line to it
every BATCHSERVE_MEMORY_TRACE_S seconds. It answers the question an RSS timeline cannot: is a growing process
holding more (a leak, a cache without a bound: `in_use_mb`, `python_objects` grow) or keeping more of what it freed
(allocator fragmentation, glibc's trim threshold: `free_mb` grows, and `malloc_trim` gives it back)?"""

from __future__ import annotations

import ctypes
import functools
import gc
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from batchserve import env

MB = 1 << 20


class _Mallinfo2(ctypes.Structure):
    # glibc >= 2.33 (malloc.h): every field a size_t
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                     "keepcost")
    ]  # fmt: skip


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _Mallinfo2
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
    except (OSError, AttributeError):
        return None  # not glibc, or older than 2.33
    return libc


@dataclass
class HeapInfo:
    """glibc's heap over all its arenas, in MB."""

    arena_mb: float  # taken from the system by sbrk/arena heaps (not the blocks mapped apart)
    in_use_mb: float  # allocated and not freed
    free_mb: float  # freed but kept in the arenas: what malloc_trim could give back, less what it cannot split
    mapped_mb: float  # blocks over the mmap threshold, mapped apart (returned on free)


def heap_info() -> HeapInfo | None:
    """This process's glibc heap now (over all arenas; takes each arena's lock), or None off glibc."""
    libc = _libc()
    if libc is None:
        return None
    info = libc.mallinfo2()
    return HeapInfo(
        round(info.arena / MB, 1),
        round(info.uordblks / MB, 1),
        round(info.fordblks / MB, 1),
        round(info.hblkhd / MB, 1),
    )


def malloc_trim() -> bool:
    """Give the heap's free pages back to the system (every arena, the middle of the heap too); True if any went."""
    libc = _libc()
    return libc is not None and libc.malloc_trim(0) == 1


@dataclass
class MemorySample:
    """One line of the trace."""

    role: str
    pid: int
    t: float  # time.time()
    rss_mb: float
    anon_mb: float
    heap: dict[str, float] | None
    python_objects: int  # objects the garbage collector tracks: grows with a leak of Python objects
    gc_counts: tuple[int, int, int]
    tracemalloc_top: list[str] = field(default_factory=list)


def sample(role: str) -> MemorySample:
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
    heap = heap_info()
    return MemorySample(
        role,
        os.getpid(),
        round(time.time(), 1),
        int(status["VmRSS"].split()[0]) / 1024,
        int(status["RssAnon"].split()[0]) / 1024,
        asdict(heap) if heap is not None else None,
        len(gc.get_objects()),
        gc.get_count(),
        _tracemalloc_top(),
    )


def _tracemalloc_top(limit: int = 8) -> list[str]:
    """The lines that allocated most of what Python holds now, when BATCHSERVE_MEMORY_TRACE_FRAMES started
    tracemalloc (it slows every allocation: a diagnosis, not a default)."""
    import tracemalloc

    if not tracemalloc.is_tracing():
        return []
    stats = tracemalloc.take_snapshot().statistics("traceback" if env.memory_trace_frames() > 1 else "lineno")
    return [f"{stat.size / MB:.2f} MB in {stat.count} blocks: {' <- '.join(map(str, stat.traceback))}" for stat in
            stats[:limit]]  # fmt: skip


def start_memory_trace(role: str) -> threading.Thread | None:
    """Start the trace thread of this process when BATCHSERVE_MEMORY_TRACE names a file; None when it does not."""
    path = env.memory_trace()
    if path is None:
        return None
    if env.memory_trace_frames() > 0:
        import tracemalloc

        tracemalloc.start(env.memory_trace_frames())
    thread = threading.Thread(
        target=_trace, args=(path, role, env.memory_trace_interval_s()), name="batchserve-memory-trace", daemon=True
    )
    thread.start()
    return thread


def _trace(path: Path, role: str, interval_s: float) -> None:
    while True:
        line = (json.dumps(asdict(sample(role))) + "\n").encode()
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one appending write a line: several processes' lines do not interleave
        finally:
            os.close(fd)
        time.sleep(interval_s)


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The trace's lines, in the order written."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
