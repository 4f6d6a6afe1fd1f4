"""Speculative decoding (n-gram prompt lookup) against none, on the default model, on four workloads whose outputs
repeat their inputs: code-edit, extract-json, summarize-quote, multi-turn (prompts made from text that ships with the package; `batchserve bench --workload NAME` makes the same ones).

For each workload: batch 1 (requests one after another) output tok/s, and concurrency 8 (eight requests in one
batch) TPOT p50, with and without speculation, alternating, plus the acceptance rate and tokens per verification
step. Greedy, so both runs must produce the same tokens (checked). Prints one line per workload and a JSON summary.

    .venv/bin/python benchmarks/speculative.py [--max-tokens 64] [--k 4] [--dtype bfloat16] [--repeats 2]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time

from batchserve import LLM, SamplingParams
from batchserve.bench.repetitive import REPETITIVE_WORKLOADS, conversations


def workloads(count: int) -> dict[str, list[list[dict]]]:
    """The four workloads as `batchserve bench --workload NAME` makes them (batchserve/bench/repetitive.py)."""
    return {name: conversations(name, count) for name in REPETITIVE_WORKLOADS}


def _run(llm: LLM, conversations, params, concurrency: int):
    stats = llm.engine.scheduler.speculation.stats if llm.engine.scheduler.speculation else None
    before = dataclasses.replace(stats) if stats else None
    tokens, tpots, outputs = 0, [], []
    start = time.perf_counter()
    for i in range(0, len(conversations), concurrency):
        for out in llm.chat(conversations[i : i + concurrency], params, use_tqdm=False):
            outputs.append(out.token_ids)
            tokens += len(out.token_ids)
            m = out.metrics
            if len(out.token_ids) > 1:
                tpots.append((m.finished_time - m.first_token_time) / (len(out.token_ids) - 1))
    elapsed = time.perf_counter() - start
    accepted = (stats.num_accepted - before.num_accepted) if stats else 0
    proposed = (stats.num_proposed - before.num_proposed) if stats else 0
    steps = (stats.num_verify_steps - before.num_verify_steps) if stats else 0
    return {
        "tok_s": tokens / elapsed, "tpot_p50_ms": 1000 * statistics.median(tpots), "outputs": outputs,
        "acceptance": accepted / proposed if proposed else 0.0,
        "tokens_per_verify": (accepted + steps) / steps if steps else 0.0,
    }  # fmt: skip


def _best(kept: dict | None, run: dict) -> dict:
    if kept is None:
        return run
    return {
        "batch1": max(kept["batch1"], run["batch1"], key=lambda r: r["tok_s"]),
        "conc8": min(kept["conc8"], run["conc8"], key=lambda r: r["tpot_p50_ms"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--repeats", type=int, default=2, help="off/on rounds, alternating; the best of each kept")
    parser.add_argument("--k-policy", default="ramp", choices=("ramp", "cost"))
    parser.add_argument("--disable-by-batch-size", type=int, default=16)
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
            "k_policy": args.k_policy, "disable_by_batch_size": args.disable_by_batch_size}  # fmt: skip
    # no prefix cache: the second run of a prompt would skip the prefill the first one paid for
    llm = LLM(dtype=args.dtype, device="cpu", speculative_config=spec, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    summary = {}
    for name, convs in workloads(args.requests).items():
        llm.chat(convs[:1], params, use_tqdm=False)  # warm-up
        result = {}
        for _ in range(args.repeats):  # off and on alternate, so a busy spell of the host hits both; best of each kept
            for speculate in (False, True):
                p = dataclasses.replace(params, speculate=speculate)
                run = {"batch1": _run(llm, convs[:2], p, 1), "conc8": _run(llm, convs, p, 8)}
                result[speculate] = _best(result.get(speculate), run)
        same = all(result[False][m]["outputs"] == result[True][m]["outputs"] for m in ("batch1", "conc8"))
        off, on = result[False], result[True]
        row = {
            "batch1_tok_s": (round(off["batch1"]["tok_s"], 1), round(on["batch1"]["tok_s"], 1)),
            "batch1_speedup": round(on["batch1"]["tok_s"] / off["batch1"]["tok_s"], 2),
            "conc8_tpot_p50_ms": (round(off["conc8"]["tpot_p50_ms"], 1), round(on["conc8"]["tpot_p50_ms"], 1)),
            "conc8_tpot_gain": round(off["conc8"]["tpot_p50_ms"] / on["conc8"]["tpot_p50_ms"], 2),
            "acceptance": round(on["batch1"]["acceptance"], 2),
            "tokens_per_verify": round(on["batch1"]["tokens_per_verify"], 2),
            "same_tokens": same,
        }
        summary[name] = row
        print(name, row, flush=True)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
