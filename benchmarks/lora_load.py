"""Time per output token of running streams while an adapter loads (docs/lora.md), in one process:

16 streams decode with an adapter; their mean step time is measured first alone, then while a second adapter is read
from its folder (off the engine loop, as the server's load endpoint does: a thread), registered, and its first request
(a short prompt) joins, which fills the adapter's device slot. Printed: both mean step times and their ratio, in the
engine thread's CPU time (the step's own cost, whatever other processes or the reading thread take of the cores) and
in wall time (which a busy host makes noisy).

    python benchmarks/lora_load.py --threads 1       # the default model, 16 streams
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from batchserve import LLM, LoRARequest, SamplingParams
from batchserve.bench.machine import describe, machine_info

sys.path.insert(0, str(Path(__file__).parent))
from lora import random_adapter  # noqa: E402  (benchmarks/lora.py, beside this script)


def timed_step(engine) -> tuple[float, float, list]:
    """(engine thread's CPU seconds, wall seconds, outputs) of one step."""
    cpu, wall = time.thread_time(), time.perf_counter()
    outputs = engine.step()
    return time.thread_time() - cpu, time.perf_counter() - wall, outputs


def timed_steps(engine, count: int, streams: int) -> list[tuple[float, float]]:
    times = []
    for _ in range(count):
        check_together(engine, streams)
        times.append(timed_step(engine)[:2])
    return times


def check_together(engine, streams: int) -> None:
    """Refuse a step that does not hold all the streams: its time would not be theirs."""
    running = len(engine.scheduler.running)
    if running < streams:
        raise RuntimeError(f"{running} of {streams} streams decode together: the step would not be theirs")


def steps_while_loading(engine, lora: LoRARequest, prompt: list[int], streams: int) -> list[tuple[float, float]]:
    """Step times from the start of the adapter's read until its first request has its first token."""
    read: dict = {}
    reader = threading.Thread(target=lambda: read.update(adapter=engine.read_lora(lora)))
    times, request_id = [], None
    reader.start()
    while True:
        check_together(engine, streams)
        cpu, wall = time.thread_time(), time.perf_counter()
        if request_id is None and not reader.is_alive():
            engine.add_lora(lora, read["adapter"])
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4, lora_name=lora.lora_name)
            request_id = engine.add_prompt(None, {"prompt_token_ids": prompt}, params)
        outputs = engine.step()
        times.append((time.thread_time() - cpu, time.perf_counter() - wall))
        if request_id is not None and any(o.request_id == request_id for o in outputs):
            return times


def report(label: str, times: list[tuple[float, float]], base: tuple[float, float] | None = None) -> tuple:
    cpu, wall = (statistics.mean(t[i] for t in times) for i in (0, 1))
    line = f"{label:26} CPU {cpu * 1e3:7.2f} ms   wall {wall * 1e3:7.2f} ms"
    if base is not None:
        line += (f"   {cpu / base[0]:.2f}x / {wall / base[1]:.2f}x over {len(times)} steps "
                 f"(longest CPU {max(t[0] for t in times) * 1e3:.2f} ms)")  # fmt: skip
    print(line, flush=True)
    return cpu, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20, help="steps timed before the load")
    args = parser.parse_args()
    llm = LLM(model=args.model, dtype=args.dtype, num_threads=args.threads, enable_lora=True, max_loras=2,
              max_lora_rank=args.rank)  # fmt: skip
    engine = llm.engine
    with tempfile.TemporaryDirectory() as tmp:
        loras = []
        for i in range(2):
            random_adapter(Path(tmp) / f"a{i}", engine.model_config, args.rank, seed=i)
            loras.append(LoRARequest(f"a{i}", i + 1, str(Path(tmp) / f"a{i}")))
        engine.add_lora(loras[0])
        print(
            f"host: {describe(machine_info(args.threads, engine.config.dtype))}; load average {os.getloadavg()[0]:.1f}"
        )
        max_tokens = 8 + 3 * args.steps + 64  # past the steps this script takes (the loading ones included)
        # a pool sized to the requests grows in generate(); driven step by step it must be grown here, or the
        # streams would take turns in a small pool (preempting each other) instead of decoding together
        engine.reserve_kv_for([(4, max_tokens)] * args.streams + [(8, 4)])
        running = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=max_tokens, lora_name="a0")
        for i in range(args.streams):
            engine.add_prompt(None, {"prompt_token_ids": [100 + i, 200, 300, 400]}, running)
        for _ in range(8):  # prompts in, warm
            engine.step()
        print(f"{args.streams} streams, adapter rank {args.rank} on all seven projections")
        before = report("step time alone", timed_steps(engine, args.steps, args.streams))
        prompt = [500, 600, 700, 800, 900, 1000, 1100, 1200]
        report("while an adapter loads", steps_while_loading(engine, loras[1], prompt, args.streams), before)
        report("after", timed_steps(engine, args.steps, args.streams), before)
        print(f"load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
