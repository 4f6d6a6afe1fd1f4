"""Single-stream decode speed of the weight formats (issue 43), indicative: batch 1 greedy on the default model (or
--model), decode tokens per second as (tokens - 1) / (time of a --tokens generation - time of a 1-token one), best of
--repeats, each format in its own engine, one after the other in one process.

    .venv/bin/python benchmarks/quant_speed.py [--formats none int8 int4] [--dtype auto] [--tokens 64] [--threads 1]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchserve import LLM, SamplingParams  # noqa: E402
from batchserve.layers import kernels  # noqa: E402

PROMPT = "Explain how a paged KV cache lets a server batch many requests at once."


def timed(llm: LLM, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate([PROMPT], params, use_tqdm=False)
    return time.perf_counter() - start


def decode_rate(fmt: str, args) -> float:
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        device="cpu",
        quantization=fmt,
        num_kv_blocks=64,
        max_batch_size=1,
        num_threads=args.threads,
    )
    timed(llm, 4)  # warm-up
    best = float("inf")
    for _ in range(args.repeats):
        best = min(best, timed(llm, args.tokens) - timed(llm, 1))
    return (args.tokens - 1) / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--formats", nargs="+", default=["none", "int8", "int4"])
    parser.add_argument("--dtype", default="auto", help="activations (and the weights of format none)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1: steadier on a busy host)")
    args = parser.parse_args()
    flags = kernels.cpu_flags().split()
    print(f"bf16 matmul units: {'yes' if 'avx512_bf16' in flags or 'amx_bf16' in flags else 'no'}; "
          f"int8 dot products (avx512_vnni): {'yes' if 'avx512_vnni' in flags else 'no'}")  # fmt: skip
    for fmt in args.formats:
        print(f"{fmt:<10} {decode_rate(fmt, args):7.1f} decode tok/s (batch 1, dtype {args.dtype})", flush=True)


if __name__ == "__main__":
    main()
