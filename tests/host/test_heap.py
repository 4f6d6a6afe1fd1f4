"""The memory debug hook (batchserve/host/heap.py): glibc's heap figures tell memory held from memory freed but
kept, malloc_trim gives the kept part back, and BATCHSERVE_MEMORY_TRACE makes a process write its trace."""

from __future__ import annotations

import ctypes
import os
import subprocess
import sys
import textwrap

import pytest

from batchserve.host.heap import heap_info, malloc_trim, read_trace

BLOCK = 16 << 10  # under any mmap threshold: from the heap
COUNT = 4096  # 64 MB in all


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.skipif(heap_info() is None, reason="glibc >= 2.33 only")
def test_freed_holes_show_as_free_heap_and_trim_gives_them_back():
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    blocks = [libc.malloc(BLOCK) for _ in range(COUNT)]
    for block in blocks:
        ctypes.memset(block, 1, BLOCK)  # resident
    held = heap_info()
    for block in blocks[::2]:  # holes between live blocks: the heap's top cannot shrink over them
        libc.free(block)
    holed, rss_holed = heap_info(), _rss_mb()
    try:
        assert held.in_use_mb - holed.in_use_mb == pytest.approx(32, abs=2)  # what is held went down ...
        assert holed.free_mb - held.free_mb >= 30  # ... and the heap kept it
        assert malloc_trim()
        assert rss_holed - _rss_mb() >= 24  # the holes' pages went back to the system
        assert heap_info().in_use_mb == pytest.approx(holed.in_use_mb, abs=1)  # nothing held was touched
    finally:
        for block in blocks[1::2]:
            libc.free(block)


def test_the_trace_is_written_by_each_process_that_starts_it(tmp_path):
    trace = tmp_path / "memory.jsonl"
    script = textwrap.dedent("""
        import time
        from batchserve.host.heap import start_memory_trace
        start_memory_trace("probe")
        time.sleep(1.3)
    """)
    environment = {**os.environ, "BATCHSERVE_MEMORY_TRACE": str(trace), "BATCHSERVE_MEMORY_TRACE_S": "0.5"}
    for _ in range(2):
        subprocess.run([sys.executable, "-c", script], env=environment, check=True, timeout=120)
    lines = read_trace(trace)
    assert len(lines) >= 4 and {line["role"] for line in lines} == {"probe"}
    assert len({line["pid"] for line in lines}) == 2
    for line in lines:
        assert line["rss_mb"] > 5 and line["python_objects"] > 1000 and line["tracemalloc_top"] == []
        assert heap_info() is None or line["heap"]["in_use_mb"] > 0
    environment["BATCHSERVE_MEMORY_TRACE_FRAMES"] = "1"  # tracemalloc on: each line names where Python's memory is
    subprocess.run([sys.executable, "-c", script], env=environment, check=True, timeout=120)
    assert all(" MB in " in top and ".py:" in top for top in read_trace(trace)[-1]["tracemalloc_top"])
    assert len(read_trace(trace)[-1]["tracemalloc_top"]) > 0


def test_no_trace_unless_asked(monkeypatch):
    from batchserve.host.heap import start_memory_trace

    monkeypatch.delenv("BATCHSERVE_MEMORY_TRACE", raising=False)
    assert start_memory_trace("probe") is None
