"""The cost of serving LoRA adapters (docs/lora.md), in one process on one host, side by side:

- peer64 on the base model alone, and peer64 with its requests spread over 8 random adapters (rank 16, all seven
  projections, max_loras 8): throughput, and the ratio;
- one stream decoding alone, with an adapter and without: time per output token, and the ratio;
- the same adapter workload with the deltas applied one request at a time (a loop over the step's requests, as
  grouping by adapter replaces): throughput, and grouped over looped.

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


def decode_steps(llm: LLM, requests: list[dict], loras: list[LoRARequest], rounds: int, steps: int) -> None:
    """Decode step times, variants alternating round by round: one stream with and without an adapter; the
    requests spread over the adapters, on the base model alone, and with the deltas one request at a time."""
    engine, pool = llm.engine, llm.engine.runner.lora
    for lora in loras:
        engine.add_lora(lora)
    prompts = [r["prompt_token_ids"][:64] for r in requests]
    spread = [loras[i % len(loras)] for i in range(len(prompts))]
    rows = []
    for _ in range(rounds):
        alone = decode_step_ms(engine, prompts[:1], [None], steps)
        alone_lora = decode_step_ms(engine, prompts[:1], loras[:1], steps)
        base = decode_step_ms(engine, prompts, [None] * len(prompts), steps)
        with_loras = decode_step_ms(engine, prompts, spread, steps)
        pool.grouping = "request"
        looped = decode_step_ms(engine, prompts, spread, steps)
        pool.grouping = "adapter"
        rows.append((alone, alone_lora, base, with_loras, looped))
        print(f"round: {alone:.2f} / {alone_lora:.2f}; {base:.2f} / {with_loras:.2f} / {looped:.2f} ms a step; "
              f"load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    best = [min(column) for column in zip(*rows)]
    print(f"cheapest decode step (process CPU time) of {rounds} round(s) x {steps} steps:")
    print(f"one stream: {best[0]:.2f} ms, with an adapter {best[1]:.2f} ms ({best[0] / best[1]:.2f}x the speed)")
    print(f"{len(prompts)} streams: base {best[2]:.2f} ms, over {len(loras)} adapters {best[3]:.2f} ms "
          f"({best[2] / best[3]:.2f}x base), deltas one request at a time {best[4]:.2f} ms "
          f"(grouped {best[4] / best[3]:.2f}x looped)")  # fmt: skip


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
        spread = [loras[i % len(loras)] for i in range(len(requests))]
        print(f"host: {describe(machine_info(args.threads, llm.engine.config.dtype))}")
        print(
            f"{len(requests)} requests of peer64, {args.adapters} adapters of rank {args.rank} on all seven projections"
        )
        if args.decode_steps:
            decode_steps(llm, requests, loras, args.rounds, args.decode_steps)
            return
        prompt = requests[0]["prompt_token_ids"]
        step_ms(llm, prompt, 8, loras[0])  # warm
        pool = llm.engine.runner.lora
        rows = []
        # each round measures every variant once: a shared host's swings of load touch all of them alike
        for _ in range(args.rounds):
            clock = CLOCK[args.clock]
            alone = step_ms(llm, prompt, args.single_tokens, None, clock)
            alone_lora = step_ms(llm, prompt, args.single_tokens, loras[0], clock)
            base = throughput(llm, requests, [None] * len(requests), clock)
            with_loras = throughput(llm, requests, spread, clock)
            pool.grouping = "request"
            looped = throughput(llm, requests, spread, clock)
            pool.grouping = "adapter"
            rows.append((alone, alone_lora, base, with_loras, looped))
            print(f"round: {alone:.2f} / {alone_lora:.2f} ms/token, {base:.1f} / {with_loras:.1f} / {looped:.1f} tok/s; "
                  f"load average {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
        median = [statistics.median(column) for column in zip(*rows)]
        ratios = [statistics.median(r[i] / r[j] for r in rows) for i, j in ((0, 1), (3, 2), (3, 4))]
        print(f"median of {args.rounds} round(s), {args.clock} clock:")
        print(f"single stream               {median[0]:8.2f} ms/token")
        print(f"single stream + adapter     {median[1]:8.2f} ms/token   {ratios[0]:.2f}x the speed without")
        print(f"peer64 base alone           {median[2]:8.1f} tok/s")
        print(f"peer64 over {args.adapters} adapters       {median[3]:8.1f} tok/s   {ratios[1]:.2f}x base")
        print(f"  deltas one request a time {median[4]:8.1f} tok/s   grouped {ratios[2]:.2f}x looped")


if __name__ == "__main__":
    main()
