"""Where a decode step's time goes on a GPU: the runner's own phase timings (prepare / forward / sample) and a
torch.profiler summary (host-side time per op, CUDA kernel time, launches and host<->device syncs) for decode steps at
a few batch sizes. A companion of gpu_check.py, same random weights of SmolLM2-135M's shapes; runs on CPU too.

    python3 benchmarks/gpu_profile.py --out "$OUT"                         # on a lent GPU
    .venv/bin/python benchmarks/gpu_profile.py --device cpu --batch-sizes 1 --steps 2   # smoke test here
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from gpu_check import engine_for, prompts, random_checkpoint, save, submit
from torch.profiler import ProfilerActivity, profile

COUNTED = ("cudaLaunchKernel", "cudaStreamSynchronize", "cudaMemcpyAsync", "cudaDeviceSynchronize", "aten::item")


def profile_decode(model: str, device: str, dtype: str, batch: int, steps: int, rng: random.Random) -> dict:
    engine = engine_for(model, device, dtype, max_batch_size=batch, max_num_tokens=max(2048, batch))
    for i, prompt in enumerate(prompts(batch, rng, 128, 128, engine.model_config.vocab_size)):
        submit(engine, str(i), prompt, 2 * steps + 16)
    while engine.scheduler.num_waiting or engine.last_stats is None or engine.last_stats.num_prefill_tokens:
        engine.step()
    for _ in range(3):
        engine.step()  # warm-up
    runner = engine.runner
    walls, phases = [], []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - start)
        timings = runner.last_timings
        phases.append((timings.prepare_s, timings.forward_s, timings.sample_s))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            engine.step()
    averages = prof.key_averages()
    counts = {e.key: e.count / steps for e in averages if e.key in COUNTED}
    device_us = sum(getattr(e, "self_device_time_total", 0) for e in averages) / steps
    top = sorted(averages, key=lambda e: e.self_cpu_time_total, reverse=True)[:25]
    row = {
        "batch": batch,
        "step_ms": statistics.median(walls) * 1e3,
        "prepare_forward_sample_ms": [round(statistics.median(p[i] for p in phases) * 1e3, 3) for i in range(3)],
        "device_kernel_ms_per_step": device_us / 1e3,
        "calls_per_step": counts,
        "top_self_cpu_us_per_step": [(e.key, round(e.self_cpu_time_total / steps, 1), e.count // steps) for e in top],
    }
    print(json.dumps(row, indent=1), flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batch-sizes", default="1,64")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    args = ap.parse_args()
    from batchserve.config import EngineConfig
    from batchserve.host.process import configure_torch

    configure_torch(None, EngineConfig().seed)
    rng = random.Random(0)
    result = {"device": args.device, "dtype": args.dtype, "torch": torch.__version__, "rows": []}
    with tempfile.TemporaryDirectory() as tmp:
        model = str(random_checkpoint(Path(tmp)))
        for batch in (int(b) for b in args.batch_sizes.split(",")):
            result["rows"].append(profile_decode(model, args.device, args.dtype, batch, args.steps, rng))
    save(result, args.out, f"gpu_profile-{args.device}")


if __name__ == "__main__":
    main()
