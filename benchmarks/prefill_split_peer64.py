"""peer64 with prefill attention "split" (chunks up to paths.SHORT_PREFILL_MAX_ROWS rows native, longer SDPA: the
default for bfloat16 on AMX) against "sdpa" (every chunk SDPA: the default before), in one process on one loaded model,
alternating, so that the host's load hits both alike. Outputs are capped at --max-tokens (the prefill is what the
two differ in; prefix caching off, so every run computes every prompt); prints each run's wall and CPU seconds and output tok/s.

    .venv/bin/python benchmarks/prefill_split_peer64.py [--rounds 2] [--max-tokens 32] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from batchserve import LLM, SamplingParams
from batchserve.bench.machine import describe, machine_info
from batchserve.layers.attention import preferred_prefill_method

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "peer64.json"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32, help="cap on each request's output tokens")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--methods", default="sdpa,split")
    args = ap.parse_args()
    requests = json.loads(WORKLOAD.read_text())["requests"]
    llm = LLM(dtype=args.dtype, num_threads=args.threads, enable_prefix_caching=False)  # every run computes its prompts
    print(describe(machine_info(threads=args.threads)))
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=min(r["max_tokens"], args.max_tokens))
        for r in requests
    ]
    llm.generate(prompts[:2], params[:2], use_tqdm=False)  # warm-up
    results: dict[str, list] = {}
    tokens = None
    for _ in range(args.rounds):
        for method in args.methods.split(","):
            os.environ["BATCHSERVE_PREFILL_ATTENTION"] = method
            preferred_prefill_method.cache_clear()  # chosen again, for this run
            load = os.getloadavg()[0]
            start, start_cpu = time.perf_counter(), time.process_time()
            outputs = llm.generate(prompts, params, use_tqdm=False)
            wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
            out = [list(o.token_ids) for o in outputs]
            tokens = tokens or out
            same = sum(a == b for a, b in zip(out, tokens, strict=True))
            n = sum(len(t) for t in out)
            results.setdefault(method, []).append(n / wall)
            print(f"{method:6s} {wall:6.2f} s wall {cpu:6.2f} CPU-s {n / wall:7.1f} tok/s; load {load:.1f}; "
                  f"{same}/{len(out)} outputs as the first run's")  # fmt: skip
    for method, rates in results.items():
        print(f"{method}: output tok/s {', '.join(f'{r:.1f}' for r in rates)}")


if __name__ == "__main__":
    main()
