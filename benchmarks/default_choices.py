"""The default model's start-up choices side by side (docs/quantization.md, docs/determinism.md): bf16 dequantized
vs quantization auto vs the GGUF file run as stored, each with and without --deterministic; peer64's output throughput (the first
--limit requests) and a single stream's time per token, every engine loaded first and then measured in alternating
rounds in one process, so a neighbour's load hits them alike; medians and the load average printed.

    python benchmarks/default_choices.py --limit 16 --rounds 3 [--threads 1] [--max-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from deterministic import WORKLOAD, single_stream_step_ms, throughput  # noqa: E402

from batchserve import LLM  # noqa: E402

CHOICES = {  # name -> (quantization, deterministic)
    "dequantized": ("none", False),
    "auto": ("auto", False),  # where the rule says as stored: the weight-only path (no W8A8)
    "as_stored": ("gguf", False),  # the kernel table's path: W8A8 where it runs
    "dequantized+det": ("none", True),
    "as_stored+det": ("gguf", True),
}


def _llm(args, quantization: str, deterministic: bool, blocks: int) -> LLM:
    """A fixed pool that holds the whole workload at once (four engines of the default pool would not fit a shared
    host's memory)."""
    return LLM(dtype=args.dtype, num_threads=args.threads, quantization=quantization, deterministic=deterministic,
               num_kv_blocks=blocks)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--limit", type=int, default=16, help="the first N requests of peer64 (0: all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--single-tokens", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=0, help="cap each request's output (0: the workload's)")
    parser.add_argument("--choices", nargs="+", default=list(CHOICES), choices=list(CHOICES))
    args = parser.parse_args()
    requests = json.loads(WORKLOAD.read_text())["requests"]
    requests = requests[: args.limit] if args.limit else requests
    if args.max_tokens:
        requests = [{**r, "max_tokens": min(r["max_tokens"], args.max_tokens)} for r in requests]
    blocks = sum(-(-(len(r["prompt_token_ids"]) + r["max_tokens"]) // 16) for r in requests) + 16
    llms = {name: _llm(args, *CHOICES[name], blocks) for name in args.choices}
    results = {name: {"tok_s": [], "step_ms": [], "load": []} for name in llms}
    for _ in range(args.rounds):
        for name, llm in llms.items():
            tok_s, _tokens = throughput(llm, requests)
            step = single_stream_step_ms(llm, requests[0]["prompt_token_ids"], args.single_tokens)
            load = os.getloadavg()[0]
            for key, value in (("tok_s", tok_s), ("step_ms", step), ("load", load)):
                results[name][key].append(value)
            print(f"{name}: {tok_s:.1f} out tok/s, single stream {step:.2f} ms/token, load {load:.1f}", file=sys.stderr)
    medians = {n: {k: round(statistics.median(v), 2) for k, v in r.items()} for n, r in results.items()}
    print(json.dumps({"dtype": args.dtype, "threads": args.threads, "requests": len(requests), "medians": medians,
                      "all": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
