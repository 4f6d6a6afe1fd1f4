"""Read a memory trace (BATCHSERVE_MEMORY_TRACE, batchserve/host/heap.py): for each process, what its RSS, glibc
heap (held, freed but kept) and Python object count did over the trace and over its second half.

    BATCHSERVE_MEMORY_TRACE=bench_results/memory.jsonl python benchmarks/soak.py --duration-s 420 ...
    python benchmarks/memory_trace.py bench_results/memory.jsonl

A process whose RSS grows with `in_use` and Python objects holds more (a leak, a cache without a bound); one whose
RSS grows with `free` keeps more of what it freed (the allocator), which malloc_trim would give back.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from batchserve.host.heap import read_trace

FIGURES = {  # column -> how to read it from a trace line
    "rss": lambda line: line["rss_mb"],
    "anon": lambda line: line["anon_mb"],
    "in_use": lambda line: (line["heap"] or {}).get("in_use_mb", float("nan")),
    "free": lambda line: (line["heap"] or {}).get("free_mb", float("nan")),
    "arena": lambda line: (line["heap"] or {}).get("arena_mb", float("nan")),
    "objects": lambda line: line["python_objects"] / 1000,
}


def summarize(lines: list[dict]) -> list[str]:
    """One row per process: each figure first -> at half -> last (MB; objects in thousands)."""
    by_process: dict[tuple[str, int], list[dict]] = {}
    for line in lines:
        by_process.setdefault((line["role"], line["pid"]), []).append(line)
    rows = [f"{'process':<24} {'minutes':>7}  " + "  ".join(f"{name + ' first/half/last':>26}" for name in FIGURES)]
    for (role, pid), points in sorted(by_process.items(), key=lambda item: item[1][0]["t"]):
        first, half, last = points[0], points[len(points) // 2], points[-1]
        cells = [f"{read(first):8.1f} {read(half):8.1f} {read(last):8.1f}" for read in FIGURES.values()]
        rows.append(f"{role + ' ' + str(pid):<24} {(last['t'] - first['t']) / 60:7.1f}  " + "  ".join(cells))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trace", type=Path)
    parser.add_argument("--top", action="store_true", help="also print each process's last tracemalloc top")
    args = parser.parse_args(argv)
    lines = read_trace(args.trace)
    print("\n".join(summarize(lines)))
    if args.top:
        last: dict[tuple[str, int], dict] = {(line["role"], line["pid"]): line for line in lines}
        for (role, pid), line in last.items():
            print(f"{role} {pid}:", *line["tracemalloc_top"], sep="\n  ")
    return 0


if __name__ == "__main__":
    sys.exit(main())
