"""The GEMMs a projection can take, side by side at each row count: which is fastest where on this CPU.

    .venv/bin/python benchmarks/gemm_by_rows.py                          # SmolLM2-135M's shapes, 1 thread, CPU clock
    .venv/bin/python benchmarks/gemm_by_rows.py --ms 8,16,64,2048 --shapes qkv,lm_head
    .venv/bin/python benchmarks/gemm_by_rows.py --dtype bfloat16         # oneDNN's bf16 GEMM against the pair kernel

For each of the default model's projection shapes (benchmarks/roofline.py's) and each M: GFLOP/s of `x @ W` (torch's
GEMM on the [in, out] copy), the native small-M kernel on its packed panels (kernels/small_gemm.cpp, this CPU's
path), oneDNN's brgemm micro-kernel on the same panels (kernels/panel_brgemm.cpp) and oneDNN's GEMM on its packed copy
(torch.ops.mkldnn._linear_pointwise): the three layouts CpuLinear may keep
(layers/linear.py row_schedule_for picks among them by M). Layer shapes cycle through 30 weight copies, as the 30
layers do, so that a weight is not still in cache from the call before; the lm_head has one. One thread, CPU seconds
of this thread (time.thread_time), so other load on a shared host does not inflate them. Prints a table and the
schedule CpuLinear builds here.

--dtype bfloat16 (a CPU with AVX512-BF16): oneDNN's bf16 GEMM on its packed copy, fewer than 4 rows padded to 4 as
the Projection pads them (kernels/projection.cpp), against the bf16 pair kernel (kernels/bf16_gemm.cpp) with its
float32 result rounded to bf16 as a layer's output is: where a split by rows would hand rows from one to the other
(CpuLinear.PAIR_MAX_M).
"""

from __future__ import annotations

import argparse
import time

import torch
from roofline import LAYER_SHAPES, LAYERS, LM_HEAD

from batchserve.bench.machine import describe, machine_info
from batchserve.layers import kernels
from batchserve.layers.linear import CpuLinear, _mkldnn_pack

SHAPES = {**LAYER_SHAPES, "lm_head": LM_HEAD}


def gflops(call, copies: int, flops: int, min_time: float) -> float:
    """GFLOP/s of call(copy) cycled over `copies` weight copies for at least `min_time` CPU seconds (after one
    warm-up pass)."""
    for c in range(copies):
        call(c)
    start, calls = time.thread_time(), 0
    while time.thread_time() - start < min_time:
        for c in range(copies):
            call(c)
        calls += copies
    return flops * calls / (time.thread_time() - start) / 1e9


def layouts(k: int, n: int, copies: int, small_path: str | None):
    """`copies` random [n, k] weights in the three layouts: [in, out], small-M panels (None without the kernel),
    oneDNN's packed copy (None without oneDNN)."""
    weights = [torch.randn(n, k) * 0.05 for _ in range(copies)]
    native = kernels.load()
    small = [native.small_gemm_pack(w, small_path) for w in weights] if small_path else None
    packed = [_mkldnn_pack(w) for w in weights]
    return [w.t().contiguous() for w in weights], small, None if packed[0] is None else packed


def row(name: str, m: int, min_time: float, small_path: str | None) -> str:
    k, n = SHAPES[name]
    copies = 1 if name == "lm_head" else LAYERS
    w_t, small, packed = layouts(k, n, copies, small_path)
    x, flops = torch.randn(m, k), 2 * m * k * n
    cells = [gflops(lambda c: torch.matmul(x, w_t[c]), copies, flops, min_time)]
    native = kernels.load()
    cells.append(gflops(lambda c: native.small_gemm(x, small[c], n), copies, flops, min_time) if small else None)
    cells.append(gflops(lambda c: native.panel_brgemm(x, small[c], n), copies, flops, min_time) if small else None)
    onednn = torch.ops.mkldnn._linear_pointwise
    packed_call = lambda c: onednn(x, packed[c], None, "none", [], "")  # noqa: E731
    cells.append(gflops(packed_call, copies, flops, min_time) if packed else None)
    text = " ".join(f"{c:>9.1f}" if c is not None else f"{'-':>9}" for c in cells)
    return f"{name:<8} {m:>5} {text}"


def bf16_row(name: str, m: int, min_time: float) -> str:
    """GFLOP/s of oneDNN's bf16 GEMM (rows padded to CpuLinear.PACKED_MIN_M) and the pair kernel at M rows."""
    k, n = SHAPES[name]
    copies = 1 if name == "lm_head" else LAYERS
    weights = [(torch.randn(n, k) * 0.05).bfloat16() for _ in range(copies)]
    native = kernels.load()
    packed = [_mkldnn_pack(w) for w in weights]
    pairs = [native.bf16_gemm_pack(w) for w in weights]
    x, flops = torch.randn(m, k).bfloat16(), 2 * m * k * n
    padded = torch.cat([x, x.new_zeros(max(0, CpuLinear.PACKED_MIN_M - m), k)])
    onednn = torch.ops.mkldnn._linear_pointwise
    cells = (
        gflops(lambda c: onednn(padded, packed[c], None, "none", [], "")[:m], copies, flops, min_time),
        gflops(lambda c: native.bf16_gemm(x, pairs[c], n).bfloat16(), copies, flops, min_time),
    )
    return f"{name:<8} {m:>5} " + " ".join(f"{c:>9.1f}" for c in cells) + f" {cells[1] / cells[0]:>9.2f}"


def main_bf16(args) -> None:
    native = kernels.load()
    if native is None or not native.bf16_gemm_available():
        raise SystemExit("--dtype bfloat16 needs the native kernels and a CPU with AVX512-BF16")
    schedule = CpuLinear.row_schedule_for("library", pairs=True)
    print(f"CpuLinear on AVX512-BF16 without AMX: {schedule.describe().split(', ')[-1]}")
    print("GFLOP/s")
    print(f"{'shape':<8} {'M':>5} {'oneDNN':>9} {'pairs':>9} {'pairs/1DNN':>9}")
    for name in args.shapes.split(","):
        for m in (int(v) for v in args.ms.split(",")):
            print(bf16_row(name, m, args.min_time), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ms", default="1,4,8,16,32,48,64,128,512,2048", help="row counts")
    ap.add_argument("--shapes", default=",".join(SHAPES), help=f"of {', '.join(SHAPES)}")
    ap.add_argument("--min-time", type=float, default=0.3, help="CPU seconds per cell")
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.dtype == "bfloat16":
        print(describe(machine_info()), "| 1 thread, CPU clock")
        return main_bf16(args)
    small_path = kernels.small_gemm_path() if kernels.load() is not None else "library"
    print(describe(machine_info()), "| 1 thread, CPU clock")
    schedule = CpuLinear.row_schedule_for(small_path, halves=kernels.avx512_in_halves())
    print(f"small-M path {small_path}; CpuLinear here (wide projections): {schedule.describe()}")
    print("GFLOP/s")
    print(f"{'shape':<8} {'M':>5} {'x @ W':>9} {'small-M':>9} {'brgemm':>9} {'oneDNN':>9}")
    for name in args.shapes.split(","):
        for m in (int(v) for v in args.ms.split(",")):
            print(row(name, m, args.min_time, None if small_path == "library" else small_path), flush=True)


if __name__ == "__main__":
    main()
