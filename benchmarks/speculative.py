"""Speculative decoding (n-gram prompt lookup) against none, on the default model, on four workloads whose outputs
repeat their inputs: code-edit, extract-json, summarize-quote, multi-turn (prompts made from text in this repo).

For each workload: batch 1 (requests one after another) output tok/s, and concurrency 8 (eight requests in one
batch) TPOT p50, with and without speculation, alternating, plus the acceptance rate and tokens per verification
step. Greedy, so both runs must produce the same tokens (checked). Prints one line per workload and a JSON summary.

    .venv/bin/python benchmarks/speculative.py [--max-tokens 64] [--k 4] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import time
from pathlib import Path

from batchserve import LLM, SamplingParams

ROOT = Path(__file__).resolve().parent.parent


def _paragraphs(path: str, count: int) -> list[str]:
    text = (ROOT / path).read_text()
    paragraphs = [p.strip() for p in text.split("\n\n") if len(p.strip()) > 200 and not p.startswith(("#", "```", "|"))]
    return paragraphs[:count]


def _functions(path: str, count: int) -> list[str]:
    source = (ROOT / path).read_text()
    blocks = [b for b in source.split("\n\n\n") if b.lstrip().startswith(("def ", "class ")) and len(b) < 1500]
    return blocks[:count]


def workloads(count: int) -> dict[str, list[list[dict]]]:
    user = lambda text: [{"role": "user", "content": text}]  # noqa: E731
    code = _functions("batchserve/core/kv_cache_manager.py", count) + _functions("batchserve/worker/sampler.py", count)
    docs = _paragraphs("docs/request-path.md", count) + _paragraphs("README.md", count)
    edits = [user(f"Add type hints and keep everything else identical. Output only the code.\n\n{c}") for c in code]
    extract = [
        user(f"From this text, output a JSON object with keys \"subject\" and \"quote\" (the first sentence, verbatim)."
             f"\n\n{d}") for d in docs
    ]  # fmt: skip
    quotes = [user(f"Summarize this text by quoting its two most important sentences word for word.\n\n{d}") for d in docs]
    turns = [
        user(f"Explain this briefly.\n\n{d}")
        + [{"role": "assistant", "content": d}, {"role": "user", "content": "Repeat your answer exactly, then add one line."}]
        for d in docs
    ]  # fmt: skip
    return {"code-edit": edits[:count], "extract-json": extract[:count], "summarize-quote": quotes[:count],
            "multi-turn": turns[:count]}  # fmt: skip


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


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    spec = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    # no prefix cache: the second run of a prompt would skip the prefill the first one paid for
    llm = LLM(dtype=args.dtype, device="cpu", speculative_config=spec, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    summary = {}
    for name, conversations in workloads(args.requests).items():
        llm.chat(conversations[:1], params, use_tqdm=False)  # warm-up
        result = {}
        for speculate in (False, True):
            p = dataclasses.replace(params, speculate=speculate)
            result[speculate] = {"batch1": _run(llm, conversations[:2], p, 1), "conc8": _run(llm, conversations, p, 8)}
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
