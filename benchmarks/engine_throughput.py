"""Output tokens/s of LLM.generate on SmolLM2: continuous batching vs one sequence at a time, in one run.

    python benchmarks/engine_throughput.py                      # 64 requests, prompts 20-300 tokens, 128 out
    python benchmarks/engine_throughput.py --num-requests 16 --skip-single

The workload: prompts of 20-300 tokens cut from real English text, 128 output tokens each, greedy,
ignore_eos. Both runs use the same engine options except max_batch_size.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time

from batchserve import LLM, SamplingParams
from batchserve.bench.corpus import CORPUS


def make_prompts(tokenizer, count: int, min_len: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    corpus = tokenizer(CORPUS).input_ids
    prompts = []
    for _ in range(count):
        length = rng.randint(min_len, max_len)
        start = rng.randrange(0, len(corpus) - length)
        prompts.append(corpus[start : start + length])
    return prompts


def timed_generate(llm: LLM, prompts: list[list[int]], output_len: int) -> dict:
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=True)
    wall = time.perf_counter() - start
    out_tokens = sum(len(o.token_ids) for o in outputs)
    in_tokens = sum(len(p) for p in prompts)
    ttfts = sorted(o.metrics.first_token_time - o.metrics.arrival_time for o in outputs)
    return {
        "wall_s": round(wall, 2),
        "output_tokens": out_tokens,
        "output_tok_s": round(out_tokens / wall, 1),
        "total_tok_s": round((out_tokens + in_tokens) / wall, 1),
        "median_ttft_s": round(ttfts[len(ttfts) // 2], 3),
        "outputs": [o.token_ids for o in outputs],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--min-prompt", type=int, default=20)
    parser.add_argument("--max-prompt", type=int, default=300)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip-single", action="store_true", help="skip the max_batch_size=1 run (it is slow)")
    parser.add_argument("--json", help="write the results here")
    args = parser.parse_args()

    options = dict(dtype=args.dtype, num_threads=args.threads, num_kv_blocks=4096)
    llm = LLM(max_batch_size=args.max_batch_size, **options)
    prompts = make_prompts(llm.tokenizer, args.num_requests, args.min_prompt, args.max_prompt, args.seed)
    llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=4), use_tqdm=False)  # warm-up
    results = {f"continuous (max_batch_size={args.max_batch_size})": timed_generate(llm, prompts, args.output_len)}
    if not args.skip_single:
        single = LLM(max_batch_size=1, **options)
        results["one at a time (max_batch_size=1)"] = timed_generate(single, prompts, args.output_len)

    print(
        f"\n{args.num_requests} requests, prompts {args.min_prompt}-{args.max_prompt} tokens, "
        f"{args.output_len} output tokens, {args.dtype}, {args.threads} threads, load {os.getloadavg()[0]:.2f}"
    )
    print(f"{'run':<40}{'output tok/s':>14}{'total tok/s':>14}{'wall s':>10}{'median TTFT s':>15}")
    for name, r in results.items():
        print(f"{name:<40}{r['output_tok_s']:>14}{r['total_tok_s']:>14}{r['wall_s']:>10}{r['median_ttft_s']:>15}")
    runs = list(results.values())
    if len(runs) == 2:
        print(
            f"speed-up of continuous batching: {runs[0]['output_tok_s'] / runs[1]['output_tok_s']:.2f}x; "
            f"identical greedy outputs: {runs[0]['outputs'] == runs[1]['outputs']}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({k: {kk: vv for kk, vv in v.items() if kk != "outputs"} for k, v in results.items()}, f, indent=2)


if __name__ == "__main__":
    main()
