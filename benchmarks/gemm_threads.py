"""How a float32 projection's GEMM splits over two threads, per GEMM a projection may take (oneDNN's packed GEMM, the
native small-M kernel, oneDNN's brgemm micro-kernel on the small-M kernel's panels), side by side at each row count.

    OMP_WAIT_POLICY=passive .venv/bin/python benchmarks/gemm_threads.py                  # SmolLM2-135M's shapes
    OMP_WAIT_POLICY=passive .venv/bin/python benchmarks/gemm_threads.py --ms 8,64 --shapes o,down

Each thread's CPU seconds over the calls (/proc/self/task/*/schedstat), not the wall, so other load on a shared host
does not inflate them: `busiest` is the thread that did the most (what the wall waits for on a quiet host), `total`
all threads, `share` the busiest's part of the total (0.50: an even split). Run it with OMP_WAIT_POLICY=passive, or
a thread's spinning between calls counts as its work. The calling thread also carries each call's own overhead (the
dispatcher, oneDNN's primitive look-up and memory descriptors: about 12 us a oneDNN call here, measured on a 16 x 16
weight), which the other thread waits through. Layer shapes cycle through 8 weight copies, so that a weight is not
still in cache from the call before.
"""

from __future__ import annotations

import argparse
import functools
import os

import torch
from roofline import LAYER_SHAPES, LM_HEAD

from batchserve.bench.machine import describe, machine_info
from batchserve.layers import kernels
from batchserve.layers.linear import _mkldnn_pack

SHAPES = {**LAYER_SHAPES, "lm_head": LM_HEAD}
COPIES = 8


def thread_cpu_s() -> dict[str, float]:
    """CPU seconds of each thread of this process, by thread id (ns resolution: schedstat)."""
    seconds = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                seconds[tid] = int(f.read().split()[0]) / 1e9
        except OSError:
            continue  # the thread ended while we looked
    return seconds


def split_cost(call, copies: int, calls: int) -> tuple[float, float]:
    """(busiest thread's, all threads') CPU microseconds per call(copy), cycling over the copies."""
    for c in range(copies):
        call(c)
    before = thread_cpu_s()
    for i in range(calls):
        call(i % copies)
    after = thread_cpu_s()
    spent = sorted((after[t] - before.get(t, 0.0) for t in after), reverse=True)
    return 1e6 * spent[0] / calls, 1e6 * sum(spent) / calls


def gemms(k: int, n: int, copies: int) -> dict:
    """name -> call(x, copy) for each float32 GEMM built here, on `copies` random [n, k] weights."""
    weights = [torch.randn(n, k) * 0.05 for _ in range(copies)]
    found = {}
    packed = [_mkldnn_pack(w) for w in weights]
    if packed[0] is not None:
        found["onednn"] = lambda x, c: torch.ops.mkldnn._linear_pointwise(x, packed[c], None, "none", [], "")
    native, path = kernels.load(), kernels.small_gemm_path()
    if native is not None and path is not None:
        panels = [native.small_gemm_pack(w, path) for w in weights]
        found["small-M"] = lambda x, c: native.small_gemm(x, panels[c], n)
        found["brgemm"] = lambda x, c: native.panel_brgemm(x, panels[c], n)
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="4,8,16,24,40,64,128", help="row counts")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {','.join(SHAPES)}")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--flops", type=float, default=3e9, help="FLOPs of calls per measurement")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"machine: {describe(machine_info(args.threads, 'float32'))}; load average {os.getloadavg()[0]:.2f}; "
        f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY', 'unset')}"
    )
    print(f"{'shape':8} {'M':>5} {'GEMM':8} {'busiest us':>11} {'total us':>9} {'share':>6} {'GFLOP/s of CPU':>15}")
    for name in args.shapes.split(","):
        k, n = SHAPES[name]
        copies = 1 if name == "lm_head" else COPIES
        found = gemms(k, n, copies)
        for m in (int(v) for v in args.ms.split(",")):
            x = torch.randn(m, k)
            calls = max(4, int(args.flops / (2 * m * k * n)))
            for gemm, call in found.items():
                busiest, total = split_cost(functools.partial(call, x), copies, calls)
                print(
                    f"{name:8} {m:5d} {gemm:8} {busiest:11.1f} {total:9.1f} {busiest / total:6.2f} "
                    f"{2 * m * k * n / total / 1e3:15.1f}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
