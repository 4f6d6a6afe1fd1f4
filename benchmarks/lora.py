"""The cost of serving LoRA adapters (docs/lora.md), in one process on one host, side by side:

- peer64 on the base model alone, and peer64 with its requests spread over 8 random adapters (rank 16, all seven
  projections, max_loras 8): throughput, and the ratio;
- one stream decoding alone, with an adapter and without: time per output token, and the ratio;
- the same adapter workload with the deltas applied one request at a time, two ways: each request its own group in
  the native kernel (the same batched step, the adapter's weights read once per request instead of once per
  adapter), and a loop over requests in torch (each request's x @ A @ B by separate matmuls, Punica's and S-LoRA's
  baseline; the native decoder loop takes its deltas from the kernel only, so this step runs the Python layers),
  beside the torch deltas grouped by adapter on that same Python path and the base model alone on it (what the
  Python layers cost without any delta): throughput, and grouped over each.

    python benchmarks/lora.py                  # the default model, the first 32 requests of peer64
    python benchmarks/lora.py --limit 0        # the whole workload
    python benchmarks/lora.py --rounds 3       # each variant 3 times, alternating: median figures and ratios
    python benchmarks/lora.py --decode-steps 20 --rounds 3 --threads 1   # decode steps' CPU time (a busy host)
    python benchmarks/lora.py --clock cpu --threads 1          # every figure in this process's CPU time
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from batchserve import LLM, LoRARequest, SamplingParams
from batchserve.bench.machine import describe, machine_info

WORKLOAD = Path(__file__).parent / "workloads" / "peer64.json"
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def random_adapter(folder: Path, config, rank: int, seed: int) -> None:
    """A PEFT-layout adapter of random A and B on every projection of every layer."""
    from batchserve.models.lora_adapters import target_shapes

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for target, (out_features, in_features) in target_shapes(config).items():
            part = "self_attn" if target in TARGETS[:4] else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_features, generator=generator) / in_features**0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_features, rank, generator=generator) * 0.01
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config_json = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS)}
    (folder / "adapter_config.json").write_text(json.dumps(config_json))


def params(n: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)


CLOCK = {"wall": time.perf_counter, "cpu": time.process_time}  # --clock cpu: this process's CPU time (a busy host)


def throughput(llm: LLM, requests: list[dict], loras: list[LoRARequest | None], clock=time.perf_counter) -> float:
    """Output tokens/s of the workload in one generate call."""
    llm.generate([{"prompt_token_ids": requests[0]["prompt_token_ids"]}], params(4), use_tqdm=False,
                 lora_request=loras[0])  # fmt: skip
    start = clock()
    outs = llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in requests],
                        [params(r["max_tokens"]) for r in requests], use_tqdm=False, lora_request=loras)  # fmt: skip
    return sum(len(o.token_ids) for o in outs) / (clock() - start)


def step_ms(llm: LLM, prompt: list[int], tokens: int, lora: LoRARequest | None, clock=time.perf_counter) -> float:
    """Mean time per output token of one request decoding alone (wall clock: first token excluded; CPU time: the
    whole request over its tokens)."""
    start = clock()
    out = llm.generate([{"prompt_token_ids": prompt}], params(tokens), use_tqdm=False, lora_request=lora)[0]
    if clock is time.perf_counter:
        return (out.metrics.finished_time - out.metrics.first_token_time) / (tokens - 1) * 1e3
    return (clock() - start) / tokens * 1e3


def decode_step_ms(engine, prompts: list[list[int]], loras: list[LoRARequest | None], steps: int) -> float:
    """The cheapest of `steps` decode steps of these requests decoding together (their prompts computed first), in
    this process's CPU time: with one thread, the step's own cost, whatever other processes take of the cores
    (with more, it counts the threads' waits at each barrier too, which a busy host lengthens)."""
    # a pool sized to the requests grows in generate(); driven step by step it must be grown here, or the requests
    # would take turns in a one-block pool (preempting each other) instead of decoding together
    engine.reserve_kv_for([(len(prompt), steps + 8) for prompt in prompts])
    ids = []
    for prompt, lora in zip(prompts, loras, strict=True):
        params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=steps + 8,
                                lora_name=lora.lora_name if lora else None)  # fmt: skip
        ids.append(engine.add_prompt(None, {"prompt_token_ids": prompt}, params))
    while engine.scheduler.num_waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        engine.step()
    running = len(engine.scheduler.running)
    if running != len(ids):
        raise RuntimeError(f"{running} of {len(ids)} requests decode together: the step would not be theirs")
    times = []
    for _ in range(steps):
        start = time.process_time()
        engine.step()
        times.append(time.process_time() - start)
    engine.abort_request(ids)
    engine.step()
    print(f"  {len(ids)} stream(s){' with adapters' if any(loras) else ''}: {min(times) * 1e3:.2f} ms", flush=True)
    return min(times) * 1e3


# the variants after the first four (one stream without and with an adapter, the streams on the base model and over
# the adapters, grouped, native kernel): the pool's (grouping, delta kernel) for the adapter workload
LOOPS = (("request", "native"), ("request", "torch"), ("adapter", "torch"))
NAMES = ("each request its own group, native kernel", "torch loop over requests (Python layers)",
         "torch, grouped by adapter (Python layers)")  # fmt: skip


def variants(runner, one, many, lora, spread: list, base: list) -> list[float]:
    """Every variant measured once, in order: one(None), one(lora), many(base), many(spread), then many(spread) with
    each of LOOPS' ways of applying the deltas (the pool put back to grouping by adapter in the native kernel), and
    last many(base) in the Python layers (what the torch ways' step costs without any delta)."""
    pool, model = runner.lora, runner.model
    row = [one(None), one(lora), many(base), many(spread)]
    for grouping, kernel in LOOPS:
        pool.grouping, pool.delta_kernel = grouping, kernel
        try:
            row.append(many(spread))
        finally:
            pool.grouping, pool.delta_kernel = "adapter", "native"
    loop, model.decoder_loop = model.decoder_loop, None  # None: the model runs its Python layers (models/llama.py)
    try:
        row.append(many(base))
    finally:
        model.decoder_loop = loop
    return row


def report(best: list[float], one_unit: str, many_unit: str, adapters: int, streams: str) -> None:
    """Each variant's figure (one stream: a time; the others: a time when many_unit is "ms", else tok/s) and its
    ratios of speed: with an adapter to without, over the adapters to the base alone, grouped to each loop."""
    speed = (lambda v: 1 / v) if many_unit == "ms" else (lambda v: v)
    print(f"single stream                {best[0]:8.2f} {one_unit}")
    print(f"single stream + adapter      {best[1]:8.2f} {one_unit}   {best[0] / best[1]:.2f}x the speed without")
    print(f"{streams}, base alone  {best[2]:8.1f} {many_unit}")
    print(f"{streams}, {adapters} adapters  {best[3]:8.1f} {many_unit}   {speed(best[3]) / speed(best[2]):.2f}x base")
    for name, value in zip(NAMES, best[4:]):
        print(f"  {name}: {value:.1f} {many_unit}, grouped {speed(best[3]) / speed(value):.2f}x it")
    print(f"  base alone, Python layers: {best[-1]:.1f} {many_unit}, {speed(best[-1]) / speed(best[2]):.2f}x base")


def decode_steps(llm: LLM, requests: list[dict], loras: list[LoRARequest], rounds: int, steps: int) -> None:
    """Decode step times, every variant in each round: one stream with and without an adapter; the requests spread
    over the adapters, on the base model alone, and with the deltas one request at a time."""
    engine = llm.engine
    for lora in loras:
        engine.add_lora(lora)
    prompts = [r["prompt_token_ids"][:64] for r in requests]
    spread = [loras[i % len(loras)] for i in range(len(prompts))]
    rows = []
    for _ in range(rounds):
        rows.append(variants(engine.runner, lambda lora: decode_step_ms(engine, prompts[:1], [lora], steps),
                             lambda each: decode_step_ms(engine, prompts, each, steps), loras[0], spread,
                             [None] * len(prompts)))  # fmt: skip
        print("round: " + " / ".join(f"{v:.2f}" for v in rows[-1]) + f" ms a step; load average "
              f"{os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    print(f"cheapest decode step (process CPU time) of {rounds} round(s) x {steps} steps:")
    report([min(column) for column in zip(*rows)], "ms", "ms", len(loras), f"{len(prompts)} streams")


def whole_runs(llm: LLM, requests: list[dict], loras: list[LoRARequest], args) -> None:
    """The workload end to end, every variant in each round (a shared host's swings of load touch all alike)."""
    prompt, clock = requests[0]["prompt_token_ids"], CLOCK[args.clock]
    step_ms(llm, prompt, 8, loras[0])  # warm
    spread = [loras[i % len(loras)] for i in range(len(requests))]
    rows = []
    for _ in range(args.rounds):
        rows.append(variants(llm.engine.runner, lambda lora: step_ms(llm, prompt, args.single_tokens, lora, clock),
                             lambda each: throughput(llm, requests, each, clock), loras[0], spread,
                             [None] * len(requests)))  # fmt: skip
        print(f"round: {rows[-1][0]:.2f} / {rows[-1][1]:.2f} ms/token, "
              + " / ".join(f"{v:.1f}" for v in rows[-1][2:]) + f" tok/s; load average {os.getloadavg()[0]:.1f}",
              flush=True)  # fmt: skip
    print(f"median of {args.rounds} round(s), {args.clock} clock:")
    report([statistics.median(column) for column in zip(*rows)], "ms/token", "tok/s", len(loras), "peer64")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--limit", type=int, default=32, help="the first N requests of peer64 (0: all)")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--single-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=1, help="measure every variant this many times, alternating")
    parser.add_argument("--clock", choices=tuple(CLOCK), default="wall",
                        help="cpu: per this process's CPU time (with --threads 1, what a busy host does not stretch)")  # fmt: skip
    parser.add_argument("--decode-steps", type=int, default=0,
                        help="time this many decode steps of each variant instead (the cheapest in CPU time: a busy host)")  # fmt: skip
    args = parser.parse_args()
    requests = json.loads(WORKLOAD.read_text())["requests"]
    requests = requests[: args.limit] if args.limit else requests
    # no prefix caching: each variant runs the same prompts, whose K/V a later variant would otherwise find cached
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads, enable_lora=True,
              max_loras=args.adapters, max_lora_rank=args.rank, enable_prefix_caching=False)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        loras = []
        for i in range(args.adapters):
            random_adapter(Path(tmp) / f"a{i}", llm.engine.model_config, args.rank, seed=i)
            loras.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        print(f"host: {describe(machine_info(args.threads, llm.engine.config.dtype))}")
        print(
            f"{len(requests)} requests of peer64, {args.adapters} adapters of rank {args.rank} on all seven projections"
        )
        if args.decode_steps:
            decode_steps(llm, requests, loras, args.rounds, args.decode_steps)
        else:
            whole_runs(llm, requests, loras, args)


if __name__ == "__main__":
    main()
