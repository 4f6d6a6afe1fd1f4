"""What structured outputs cost: the peer64 workload (64 requests, greedy, ignore_eos, exactly max_tokens each) run
free and with every request under a JSON schema, on one engine instance, side by side (after one free warm-up run
of the same requests).

    .venv/bin/python benchmarks/structured_outputs.py --dtype float32 --threads 2
    .venv/bin/python benchmarks/structured_outputs.py --limit 16          # a quick check
    .venv/bin/python benchmarks/structured_outputs.py --limit 64 --max-tokens 32 --rounds 3   # decode steps only
    .venv/bin/python benchmarks/structured_outputs.py --limit 64 --max-tokens 32 --rounds 6 --overlap alternate
    .venv/bin/python benchmarks/structured_outputs.py --masks-only 64     # no model; ends with a GIL probe

The constrained runs are made with the masks filled during the forward pass (overlap on) and after it (off); each
round runs free, on and off in turn so that a shared host's load falls on all of them, and best and median walls
are printed. `--overlap alternate` instead switches the setting at every step of constrained runs and compares
their decode steps, which meet the same load. The schema (an array of at least 100 short strings) cannot be
complete within any request's max_tokens, so every constrained token is a real grammar step (never the cheap "only
EOS now" mask) and every run produces the same number of tokens. Printed: output throughput of each run and the
cost; the grammar's mask time per step (filling the bitmasks of every constrained row, timed around
StructuredOutputs.fill_rows in whichever thread fills them) at the largest batch, and the time the step waits for
them (StructuredOutputs.masks); and the time to first token of a schema's first use (compiled in the worker)
against its reuse (cached) and against no schema.
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
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"],
        },  # fmt: skip
    },
    "required": ["name", "age", "tags", "address"],
}


def timed_masks(runner) -> list[tuple[int, float]]:
    """Wraps the worker's fill_rows (xgrammar filling the rows, in whichever thread fills them): (rows, seconds)
    per call."""
    record: list[tuple[int, float]] = []
    structured = runner.structured_outputs
    fill = structured.fill_rows

    def timed(bitmask, rows):
        start = time.perf_counter()
        fill(bitmask, rows)
        record.append((len(rows), time.perf_counter() - start))

    structured.fill_rows = timed
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
    gil_probe(structured, req_ids)


def gil_probe(structured, req_ids: list[str], seconds: float = 1.0) -> None:
    """Does xgrammar release the GIL while it fills? A pure-Python loop's pace alone, then while another thread
    fills masks back to back: a fill that held the GIL would halve it (or worse)."""
    import threading

    def spin() -> int:
        count, end = 0, time.perf_counter() + seconds
        while time.perf_counter() < end:
            count += 1
        return count

    alone = spin()
    stop, fills = threading.Event(), []

    def fill_until_stopped() -> None:
        while not stop.is_set():
            start = time.perf_counter()
            structured.fill_masks(req_ids)
            fills.append(time.perf_counter() - start)

    filler = threading.Thread(target=fill_until_stopped)
    filler.start()
    beside = spin()
    stop.set()
    filler.join()
    print(f"GIL probe: a Python loop keeps {100 * beside / alone:.0f}% of its pace while another thread fills masks "
          f"({len(fills)} fills, median {ms(fills)})")  # fmt: skip


def timed_waits(runner) -> list[float]:
    """Wraps the worker's masks(): the seconds the step's thread waits for its bitmask (with overlap, what the
    fill running beside the forward pass still costs it)."""
    record: list[float] = []
    structured = runner.structured_outputs
    take = structured.masks

    def timed(req_ids):
        start = time.perf_counter()
        mask = take(req_ids)
        if mask is not None:
            record.append(time.perf_counter() - start)
        return mask

    structured.masks = timed
    return record


def ms(values: list[float], pick=statistics.median) -> str:
    return f"{1e3 * pick(values):.3f} ms" if values else "-"


def measure_rounds(llm, requests, constraint, overlaps: list[bool], rounds: int) -> dict[str, dict[str, list]]:
    """`rounds` times: one free run, then one constrained run per overlap setting (alternated, so a busy host's
    load spreads over all of them). Per run: wall seconds, output tokens, per-step phases, fills, waits."""
    runner = llm.engine.runner
    masks, waits, steps = timed_masks(runner), timed_waits(runner), timed_steps(llm.engine)
    results: dict[str, dict[str, list]] = {}
    for _ in range(rounds):
        for name, overlap in [("free", None)] + [(f"schema, overlap {'on' if o else 'off'}", o) for o in overlaps]:
            runner.structured_outputs.overlap = bool(overlap)
            masks.clear(), waits.clear(), steps.clear()
            wall, tokens = run(llm, requests, constraint if overlap is not None else None)
            entry = results.setdefault(name, {"wall": [], "tokens": [], "steps": [], "fill": [], "wait": []})
            entry["wall"].append(wall)
            entry["tokens"].append(tokens)
            entry["steps"].append(dict(steps))
            top = max((rows for rows, _ in masks), default=0)  # the fills at the run's largest batch
            entry["fill"] += [seconds for rows, seconds in masks if rows == top]
            entry["wait"] += list(waits)
    return results


def alternated_steps(llm, requests, constraint, rounds: int) -> dict[bool, list[float]]:
    """Constrained runs whose steps switch overlap on and off in turn, so both settings meet the same host load:
    forward + sampling seconds of each decode step (every row constrained; a run's first step, its prefill, is
    left out) by setting."""
    structured, engine, step = llm.engine.runner.structured_outputs, llm.engine, llm.engine.step
    per_setting: dict[bool, list[float]] = {True: [], False: []}
    count, in_run = 0, 0

    def flipped():
        nonlocal count, in_run
        count, in_run = count + 1, in_run + 1
        structured.overlap = bool(count % 2)
        out = step()
        phases = engine.last_timings
        if phases.forward_s and in_run > 1:
            per_setting[structured.overlap].append(phases.forward_s + phases.sample_s)
        return out

    engine.step = flipped
    try:
        for _ in range(rounds):
            in_run = 0
            run(llm, requests, constraint)
    finally:
        del engine.step
        structured.overlap = True
    return per_setting


def report(results: dict[str, dict[str, list]]) -> None:
    free_best = min(results["free"]["wall"])
    for name, entry in results.items():
        walls, tokens = entry["wall"], entry["tokens"][0]
        assert all(t == tokens for t in entry["tokens"]), entry["tokens"]
        best = min(range(len(walls)), key=walls.__getitem__)
        phases = entry["steps"][best]
        per_step = {k: 1e3 * v / phases["steps"] for k, v in phases.items() if k != "steps"}
        print(f"{name:22} wall best {walls[best]:6.2f} s ({tokens / walls[best]:6.1f} out tok/s, cost vs free best "
              f"{100 * (walls[best] / free_best - 1):+5.1f}%), median {statistics.median(walls):6.2f} s over "
              f"{len(walls)} runs; best run per step ({phases['steps']:.0f} steps): forward "
              f"{per_step['forward_s']:.2f} ms, sampling {per_step['sample_s']:.2f} ms")  # fmt: skip
        step_ms = [1e3 * (ph["forward_s"] + ph["sample_s"]) / ph["steps"] for ph in entry["steps"]]
        print(
            f"{'':22} forward + sampling per step: best {min(step_ms):.2f} ms, median {statistics.median(step_ms):.2f} ms"
        )
        if entry["fill"]:
            print(f"{'':22} mask fill at the largest batch: median {ms(entry['fill'])}, max "
                  f"{ms(entry['fill'], max)}; the step's wait for its masks: median {ms(entry['wait'])}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--limit", type=int, default=0, help="the first N requests only")
    parser.add_argument("--max-tokens", type=int, default=0, help="cap each request's max_tokens (a shorter run)")
    parser.add_argument(
        "--overlap",
        choices=["on", "off", "both", "alternate"],
        default="both",
        help="fill the masks during the forward pass (BATCHSERVE_GRAMMAR_OVERLAP), or not, or both",
    )
    parser.add_argument("--rounds", type=int, default=1, help="free and constrained runs, alternated, this often")
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
    warm = json_schema_constraint({"type": "string", "maxLength": 4}, "warm-up")
    ttft(llm, requests[0]["prompt_token_ids"], warm)  # builds the compiler (tokenizer info) once, off the clock
    run(llm, requests, None)  # warm: the first run of a fresh engine pays for allocations the others reuse

    if args.overlap == "alternate":
        per_setting = alternated_steps(llm, requests, json_schema_constraint(LONG_SCHEMA, "bench"), args.rounds)
        for overlap, times in per_setting.items():
            print(f"overlap {'on ' if overlap else 'off'}: forward + sampling per step median {ms(times)}, mean "
                  f"{ms(times, statistics.mean)} over {len(times)} steps")  # fmt: skip
        return
    overlaps = {"on": [True], "off": [False], "both": [True, False]}[args.overlap]
    results = measure_rounds(llm, requests, json_schema_constraint(LONG_SCHEMA, "bench"), overlaps, args.rounds)
    prompt = requests[1]["prompt_token_ids"]
    schema = json_schema_constraint(TTFT_SCHEMA, "bench")
    ttft_free = ttft(llm, prompt, None)
    ttft_first, ttft_reuse = ttft(llm, prompt, schema), ttft(llm, prompt, schema)

    print(f"host: {platform.processor() or platform.machine()}, {args.threads} threads, {args.dtype}, "
          f"{len(requests)} requests, {results['free']['tokens'][0]} output tokens each run")  # fmt: skip
    report(results)
    print(f"TTFT: no schema {1e3 * ttft_free:.1f} ms, schema first use (compile) {1e3 * ttft_first:.1f} ms, "
          f"reuse {1e3 * ttft_reuse:.1f} ms")  # fmt: skip


if __name__ == "__main__":
    main()
