"""The cost of --deterministic (docs/determinism.md): peer64's throughput and a single stream's step time, each with
and without the mode, in one process on one host (the modes alternate, `--rounds` times, so a neighbour's load hits
both alike). Also checks the mode's promise on the workload: its tokens with max_batch_size 64 equal those of a run
with max_batch_size 5 (another batch around every request).

    python benchmarks/deterministic.py                        # bf16, the whole peer64 workload, 2 rounds
    python benchmarks/deterministic.py --limit 16 --rounds 1  # a quick look
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from batchserve import LLM, SamplingParams

WORKLOAD = Path(__file__).parent / "workloads" / "peer64.json"


def _llm(args, deterministic: bool, **options) -> LLM:
    llm = LLM(dtype=args.dtype, num_threads=args.threads, deterministic=deterministic, **options)
    llm.engine.reserve_kv_blocks(llm.engine.max_kv_blocks)
    return llm


def _params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)


def throughput(llm: LLM, requests: list[dict]) -> tuple[float, list[list[int]]]:
    """Output tokens/s of the workload in one generate call, and its tokens."""
    llm.generate([{"prompt_token_ids": requests[0]["prompt_token_ids"]}], _params(4), use_tqdm=False)  # warm
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in requests],
                        [_params(r["max_tokens"]) for r in requests], use_tqdm=False)  # fmt: skip
    wall = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outs) / wall, [list(o.token_ids) for o in outs]


def single_stream_step_ms(llm: LLM, prompt: list[int], tokens: int) -> float:
    """Mean time per output token of one request decoding alone (its prefill subtracted: first token excluded)."""
    out = llm.generate([{"prompt_token_ids": prompt}], _params(tokens), use_tqdm=False)[0]
    metrics = out.metrics
    return (metrics.finished_time - metrics.first_token_time) / (tokens - 1) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--limit", type=int, default=0, help="only the first N requests of peer64 (0: all)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--single-tokens", type=int, default=128)
    parser.add_argument("--skip-check", action="store_true", help="skip the max_batch_size 5 run of the check")
    args = parser.parse_args()
    requests = json.loads(WORKLOAD.read_text())["requests"]
    requests = requests[: args.limit] if args.limit else requests
    llms = {mode: _llm(args, mode, max_batch_size=64) for mode in (False, True)}
    results: dict[bool, dict[str, list[float]]] = {mode: {"tok_s": [], "step_ms": []} for mode in llms}
    tokens = {}
    for _ in range(args.rounds):
        for mode, llm in llms.items():
            tok_s, tokens[mode] = throughput(llm, requests)
            results[mode]["tok_s"].append(tok_s)
            step = single_stream_step_ms(llm, requests[0]["prompt_token_ids"], args.single_tokens)
            results[mode]["step_ms"].append(step)
            print(f"deterministic={mode}: {tok_s:.1f} out tok/s, single stream {step:.2f} ms/token", file=sys.stderr)
    report = {
        "dtype": args.dtype,
        "threads": args.threads,
        "requests": len(requests),
        "output_tok_s": {f"deterministic={m}": [round(v, 1) for v in r["tok_s"]] for m, r in results.items()},
        "single_stream_ms_per_token": {
            f"deterministic={m}": [round(v, 2) for v in r["step_ms"]] for m, r in results.items()
        },
    }
    best = {m: (max(r["tok_s"]), min(r["step_ms"])) for m, r in results.items()}
    report["throughput_cost"] = round(1 - best[True][0] / best[False][0], 3)
    report["single_stream_cost"] = round(best[True][1] / best[False][1] - 1, 3)
    report["tokens_equal_across_modes"] = tokens[True] == tokens[False]
    if not args.skip_check:
        small = _llm(args, True, max_batch_size=5)
        _, small_tokens = throughput(small, requests)
        report["deterministic_tokens_equal_batch_64_vs_5"] = small_tokens == tokens[True]
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
