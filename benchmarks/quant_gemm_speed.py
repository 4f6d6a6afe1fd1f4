"""GEMM-level time of the quantized kernels' paths on SmolLM2-135M's four decoder projections (qkv
960x576, o 576x576, gate/up 3072x576, down 576x1536), random weights: microseconds per call summed over the four, best
of --repeats timings of --calls calls, at each row count. Columns:

  register    the avx512 weight-only register path at every M (codes widened to float32 per row block)
  bf16_tiles  avx512 above 16 rows: dequantized tiles rounded to bf16 and the bf16 GEMM (a bf16 model's default)
  w8a8_row / w8a8_32 / w8a8_16   avx512_vnni: activations rounded to int8 per row / per 32 k / per 16 k (the default)
  amx         from 1 row: the weight dequantized into bf16 tiles per 32 columns and multiplied on AMX (only where
              the CPU has AMX: quant_amx.cpp); on any CPU with AVX512-BF16 a last line gives the dequantization's
              share, the same at every row count
  bf16        the unquantized bf16 projection (CpuLinear on a bf16 weight), the reference to beat

    .venv/bin/python benchmarks/quant_gemm_speed.py [--bits 8|4] [--rows 1 16 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchserve.layers import kernels, quantization  # noqa: E402
from batchserve.layers.linear import CpuLinear  # noqa: E402

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))  # (out, in) of qkv, o, gate/up, down
MANY_ROWS = 1 << 40  # small_max_m past any batch: the register path at every M


def best_us(call, calls: int, repeats: int) -> float:
    call()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def projections(native, weight: torch.Tensor, scheme: quantization.QuantScheme) -> dict:
    codes, scales = quantization.quantize(weight, scheme)
    group = scheme.group_for(weight.shape[1])

    def quantized(**options):
        return native.quantized_projection(codes, scales, scheme.bits, group, None, **options)

    paths = {
        "register": quantized(path="avx512", small_max_m=MANY_ROWS),
        "bf16_tiles": quantized(path="avx512", small_max_m=16, bf16_tiles=True),
        "w8a8_row": quantized(path=quantization.W8A8_PATH, small_max_m=16, act_block=0),
        "w8a8_32": quantized(path=quantization.W8A8_PATH, small_max_m=16, act_block=32),
        "w8a8_16": quantized(path=quantization.W8A8_PATH, small_max_m=16, act_block=16),
    }
    if native.quant_amx_available():
        paths["amx"] = quantized(
            path=quantization.W8A8_PATH, small_max_m=16, act_block=16, bf16_tiles=True, amx_min_m=1
        )
    paths["bf16"] = CpuLinear(torch.nn.Parameter(weight.bfloat16()), None)
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bits", type=int, choices=(8, 4), default=8, help="int8 per channel or int4 in groups of 32")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    native = kernels.load()
    if native is None or not quantization.quant_gemm_path_runs(quantization.W8A8_PATH):
        sys.exit("needs the native kernels built with AVX512-VNNI on a CPU that has it")
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    scheme = quantization.QuantScheme(8, None) if args.bits == 8 else quantization.QuantScheme(4, 32)
    layers = [(k, projections(native, torch.randn(n, k), scheme)) for n, k in SHAPES]
    names = list(layers[0][1])
    print(f"{scheme.name}, {args.threads} thread(s); us per call, the four projections summed")
    print("rows  " + "".join(f"{name:>11}" for name in names))
    for rows in args.rows:
        totals = dict.fromkeys(names, 0.0)
        for k, paths in layers:
            x = torch.randn(rows, k)
            for name, layer in paths.items():
                rows_in = x.bfloat16() if name in ("bf16", "amx") else x
                totals[name] += best_us(lambda: layer(rows_in), args.calls, args.repeats)  # noqa: B023
        print(f"{rows:>4}  " + "".join(f"{totals[name]:>11.0f}" for name in names), flush=True)
    if native.quant_amx_vectorized():  # the AMX path's work besides its tile products, once a call at any M
        dequantize = sum(
            best_us(lambda p=paths["w8a8_16"]: native.quant_amx_panels(p, True), args.calls, args.repeats)
            for _, paths in layers
        )
        print(f"the AMX path's dequantization into bf16 tiles (AVX-512), any rows: {dequantize:.0f} us")


if __name__ == "__main__":
    main()
