"""Time per output token of running streams while an adapter loads (docs/lora.md), in one process:

16 streams decode with an adapter; their mean step time is measured first alone, then while a second adapter is read
from its folder (off the engine loop, as the server's load endpoint does: a thread), registered, and its first request
(a short prompt) joins, which fills the adapter's device slot. Printed: both mean step times and their ratio.

    python benchmarks/lora_load.py                   # the default model, 16 streams
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


def timed_steps(engine, count: int) -> list[float]:
    times = []
    for _ in range(count):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times


def steps_while_loading(engine, lora: LoRARequest, prompt: list[int]) -> list[float]:
    """Step times from the start of the adapter's read until its first request has its first token."""
    read: dict = {}
    reader = threading.Thread(target=lambda: read.update(adapter=engine.read_lora(lora)))
    times, request_id = [], None
    reader.start()
    while True:
        start = time.perf_counter()
        if request_id is None and not reader.is_alive():
            engine.add_lora(lora, read["adapter"])
            params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=4, lora_name=lora.lora_name)
            request_id = engine.add_prompt(None, {"prompt_token_ids": prompt}, params)
        outputs = engine.step()
        times.append(time.perf_counter() - start)
        if request_id is not None and any(o.request_id == request_id for o in outputs):
            return times


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
        running = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=10_000, lora_name="a0")
        for i in range(args.streams):
            engine.add_prompt(None, {"prompt_token_ids": [100 + i, 200, 300, 400]}, running)
        timed_steps(engine, 8)  # prompts in, warm
        before = statistics.mean(timed_steps(engine, args.steps))
        during = steps_while_loading(engine, loras[1], [500, 600, 700, 800, 900, 1000, 1100, 1200])
        after = statistics.mean(timed_steps(engine, args.steps))
        print(f"{args.streams} streams, adapter rank {args.rank} on all seven projections")
        print(f"step time alone            {before * 1e3:8.2f} ms")
        print(f"while an adapter loads     {statistics.mean(during) * 1e3:8.2f} ms over {len(during)} steps "
              f"(longest {max(during) * 1e3:.2f} ms)   {statistics.mean(during) / before:.2f}x")  # fmt: skip
        print(f"after                      {after * 1e3:8.2f} ms; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
