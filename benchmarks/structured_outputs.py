"""What structured outputs cost: the peer64 workload (64 requests, greedy, ignore_eos, exactly max_tokens each) run
once free and once with every request under a JSON schema, on one engine instance, side by side (after one
free warm-up run of the same requests).

    .venv/bin/python benchmarks/structured_outputs.py --dtype float32 --threads 2
    .venv/bin/python benchmarks/structured_outputs.py --limit 16          # a quick check

The schema (an array of at least 100 short strings) cannot be complete within any request's max_tokens, so every
constrained token is a real grammar step (never the cheap "only EOS now" mask) and both runs produce the same number
of tokens. Printed: output throughput of each run and the cost; the grammar's mask time per step (filling the
bitmasks of every constrained row, timed around StructuredOutputs.fill_masks) by batch size; and the time to first
token of a schema's first use (compiled in the worker) against its reuse (cached) and against no schema.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "peer64.json"
LONG_SCHEMA = {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 100}
TTFT_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                    "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]},  # fmt: skip
    },
    "required": ["name", "age", "tags", "address"],
}


def timed_masks(runner) -> list[tuple[int, float]]:
    """Wraps the worker's fill_masks: (constrained rows, seconds) per call."""
    record: list[tuple[int, float]] = []
    structured = runner.structured_outputs
    fill = structured.fill_masks

    def timed(req_ids):
        start = time.perf_counter()
        mask = fill(req_ids)
        if mask is not None:
            record.append((sum(r in structured for r in req_ids), time.perf_counter() - start))
        return mask

    structured.fill_masks = timed
    return record


def timed_steps(engine) -> dict[str, float]:
    """Wraps engine.step: the runner's phases summed over the steps (forward and sampling apart, so the grammar's
    share is read from the sampling phase, whatever a busy host does to the rest), and the step count."""
    totals: dict[str, float] = {}
    step = engine.step

    def timed():
        out = step()
        for name in ("prepare_s", "forward_s", "sample_s"):
            totals[name] = totals.get(name, 0.0) + getattr(engine.last_timings, name, 0.0)
        totals["steps"] = totals.get("steps", 0) + 1
        return out

    engine.step = timed
    return totals


def run(llm, requests, constraint) -> tuple[float, int]:
    from batchserve.sampling_params import SamplingParams

    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r["max_tokens"],
                             structured_outputs=constraint) for r in requests]  # fmt: skip
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outputs)


def ttft(llm, prompt_ids, constraint) -> float:
    from batchserve.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, structured_outputs=constraint)
    (out,) = llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
    return out.metrics.first_token_time - out.metrics.arrival_time


def masks_only(batch: int, steps: int) -> None:
    """The grammar's share of a step without the model: `batch` sequences under the long schema, each step filling
    every row's mask, applying it to [batch, V] logits and advancing by the masked argmax of random logits."""
    import torch

    from batchserve.models.loader import default_model_path, load_model_config, load_tokenizer
    from batchserve.serving.structured import json_schema_constraint
    from batchserve.worker.structured_output import StructuredOutputs, apply_token_bitmask

    path = default_model_path()
    config, tokenizer = load_model_config(path), load_tokenizer(path, None)
    structured = StructuredOutputs(config.vocab_size, config.eos_token_ids, tokenizer)
    constraint = json_schema_constraint(LONG_SCHEMA, "bench")
    req_ids = [str(i) for i in range(batch)]
    for r in req_ids:
        structured.add(r, constraint)
    generator = torch.Generator().manual_seed(0)
    fill_s, apply_s = [], []
    for _ in range(steps):
        logits = torch.randn(batch, config.vocab_size, generator=generator)
        start = time.perf_counter()
        mask = structured.fill_masks(req_ids)
        filled = time.perf_counter()
        masked = apply_token_bitmask(logits, mask, in_place=True)  # as the sampler does without logprobs
        apply_s.append(time.perf_counter() - filled)
        fill_s.append(filled - start)
        structured.accept(req_ids, masked.argmax(-1).tolist())
    print(f"masks only, batch {batch}, {steps} steps, vocabulary {config.vocab_size}: fill median "
          f"{1e3 * statistics.median(fill_s):.3f} ms (p90 {1e3 * sorted(fill_s)[int(0.9 * steps)]:.3f}), apply median "
          f"{1e3 * statistics.median(apply_s):.3f} ms")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=0, help="the first N requests only")
    parser.add_argument("--max-tokens", type=int, default=0, help="cap each request's max_tokens (a shorter run)")
    parser.add_argument("--masks-only", type=int, default=0, metavar="BATCH",
                        help="only time the masks of BATCH sequences, without the model")  # fmt: skip
    args = parser.parse_args()
    if args.masks_only:
        masks_only(args.masks_only, steps=200)
        return

    from batchserve.entrypoints.llm import LLM
    from batchserve.serving.structured import json_schema_constraint

    requests = json.loads(WORKLOAD.read_text())["requests"]
    requests = requests[: args.limit] if args.limit else requests
    if args.max_tokens:
        requests = [{**r, "max_tokens": min(r["max_tokens"], args.max_tokens)} for r in requests]
    llm = LLM(dtype=args.dtype, num_threads=args.threads, max_batch_size=64)
    llm.engine.reserve_kv_blocks(llm.engine.max_kv_blocks)
    masks = timed_masks(llm.engine.runner)
    warm = json_schema_constraint({"type": "string", "maxLength": 4}, "warm-up")
    ttft(llm, requests[0]["prompt_token_ids"], warm)  # builds the compiler (tokenizer info) once, off the clock

    long_schema = json_schema_constraint(LONG_SCHEMA, "bench")
    run(llm, requests, None)  # warm: the first run of a fresh engine pays for allocations the others reuse
    steps = timed_steps(llm.engine)
    free_s, free_tokens = run(llm, requests, None)
    free_steps = dict(steps)
    steps.clear()
    masks.clear()
    constrained_s, constrained_tokens = run(llm, requests, long_schema)
    assert free_tokens == constrained_tokens, (free_tokens, constrained_tokens)

    prompt = requests[1]["prompt_token_ids"]
    schema = json_schema_constraint(TTFT_SCHEMA, "bench")
    ttft_free = ttft(llm, prompt, None)
    ttft_first, ttft_reuse = ttft(llm, prompt, schema), ttft(llm, prompt, schema)

    print(f"host: {platform.processor() or platform.machine()}, {args.threads} threads, {args.dtype}, "
          f"{len(requests)} requests, {free_tokens} output tokens each run")  # fmt: skip
    print(f"free:        {free_s:7.2f} s  {free_tokens / free_s:7.1f} out tok/s")
    print(f"JSON schema: {constrained_s:7.2f} s  {constrained_tokens / constrained_s:7.1f} out tok/s  "
          f"cost {100 * (constrained_s / free_s - 1):+.1f}%")  # fmt: skip
    for name, phases in (("free", free_steps), ("JSON schema", steps)):
        per_step = {k: 1e3 * v / phases["steps"] for k, v in phases.items() if k != "steps"}
        print(f"{name:12} per step ({phases['steps']:.0f} steps): prepare {per_step['prepare_s']:.2f} ms, forward "
              f"{per_step['forward_s']:.2f} ms, sampling {per_step['sample_s']:.2f} ms")  # fmt: skip
    by_batch: dict[int, list[float]] = {}
    for rows, seconds in masks:
        by_batch.setdefault(rows, []).append(seconds)
    for rows in sorted(by_batch, reverse=True)[:3]:
        times = by_batch[rows]
        print(f"mask time per step at batch {rows}: median {1e3 * statistics.median(times):.3f} ms, "
              f"max {1e3 * max(times):.3f} ms over {len(times)} steps")  # fmt: skip
    print(f"TTFT: no schema {1e3 * ttft_free:.1f} ms, schema first use (compile) {1e3 * ttft_first:.1f} ms, "
          f"reuse {1e3 * ttft_reuse:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
