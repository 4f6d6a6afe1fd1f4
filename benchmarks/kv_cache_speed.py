"""Decode throughput by KV pool format (docs/kv-cache-quantization.md), indicative: the default model (or --model),
greedy, B requests of a short prompt generating --tokens each, tokens / wall time of the whole generate call, best and
median of --repeats alternating rounds (one measurement of each format per round, all engines loaded first).

    .venv/bin/python benchmarks/kv_cache_speed.py [--kv bfloat16 int8] [--batches 1 32] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchserve import LLM, SamplingParams  # noqa: E402
from batchserve.layers import kernels  # noqa: E402

PROMPT = "Explain how a paged KV cache lets a server batch many requests at once."


def rate(llm: LLM, batch: int, tokens: int) -> float:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([PROMPT] * batch, params, use_tqdm=False)
    return sum(len(o.token_ids) for o in outputs) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--kv", nargs="+", default=["bfloat16", "int8"])
    parser.add_argument("--batches", nargs="+", type=int, default=[1, 32])
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    flags = kernels.cpu_flags().split()
    print(f"bf16 matmul units: {'yes' if 'avx512_bf16' in flags or 'amx_bf16' in flags else 'no'}")
    engines = {
        kv: LLM(model=args.model, dtype=args.dtype, device="cpu", kv_cache_dtype=kv, num_kv_blocks=512,
                max_batch_size=max(args.batches), num_threads=args.threads)
        for kv in args.kv
    }  # fmt: skip
    for llm in engines.values():
        rate(llm, 1, 4)  # warm-up
    print(f"{args.dtype} weights, {args.threads} thread(s), {args.tokens} tokens a request, {args.repeats} rounds")
    print(f"{'batch':>5} " + " ".join(f"{kv + ' best/median':>24}" for kv in args.kv))
    for batch in args.batches:
        runs = {kv: [] for kv in args.kv}
        for _ in range(args.repeats):
            for kv, llm in engines.items():
                runs[kv].append(rate(llm, batch, args.tokens))
        cells = [f"{max(r):11.1f} / {statistics.median(r):8.1f}" for r in runs.values()]
        print(f"{batch:>5} " + " ".join(f"{c:>24}" for c in cells))


if __name__ == "__main__":
    main()
