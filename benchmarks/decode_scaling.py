"""Decode step time against the number of running sequences, with host drift cancelled.

    .venv/bin/python benchmarks/decode_scaling.py                       # B = 1 8 16 32 64, 180-token prompts
    .venv/bin/python benchmarks/decode_scaling.py --batch-sizes 32,64 --rounds 16
    .venv/bin/python benchmarks/decode_scaling.py --batch-sizes 64,256 --prompt-len 64   # the host-overhead split
    .venv/bin/python benchmarks/decode_scaling.py --batch-sizes 32,64 --background-load 0.25   # a busy neighbour

One engine per batch size, all sharing the loaded weights (each with its own KV pool). Each is filled with B requests
of random prompt tokens and prefilled; then the engines take one decode step each in turn, round after round, so a
change of the host's load hits every batch size alike. Prints the median step time, tok/s and ms per sequence, and
where the step went (medians of the engine's StepTimings): the scheduler, input preparation, the forward pass (model
and logits), sampling, and the outputs (scheduler update, detokenization); "host" is everything but the forward pass.

--background-load F runs another process that keeps one core busy a fraction F of every 10 ms (as a server's front
end or Ray's processes do beside the engine on a small machine), to see how the step's threads ride out being
preempted; the mean step time then says more than the median.
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import random
import statistics
import time
from collections.abc import Iterator

from batchserve.bench.offline import build_engine
from batchserve.config import EngineConfig
from batchserve.engine.llm_engine import StepTimings
from batchserve.host.process import configure_torch
from batchserve.sampling_params import SamplingParams


def filled_engine(batch_size: int, max_batch: int, prompt_len: int, like, rng: random.Random, threads: int):
    config = EngineConfig.from_options(max_batch_size=max_batch, max_num_tokens=8192, num_threads=threads)
    engine = build_engine(config, like=like, share_runner=False)
    params = SamplingParams(max_tokens=4096, ignore_eos=True, temperature=0.0)
    for i in range(batch_size):
        engine.add_request(f"{batch_size}-{i}", [rng.randrange(100, 40000) for _ in range(prompt_len)], params)
    while engine.last_stats is None or engine.last_stats.num_prefill_tokens or engine.scheduler.waiting:
        engine.step()
    return engine


def keep_busy(fraction: float, period_s: float = 0.010) -> None:
    """Spin `fraction` of every period, sleep the rest, until killed."""
    while True:
        start = time.perf_counter()
        while time.perf_counter() - start < fraction * period_s:
            pass
        time.sleep(period_s * (1 - fraction))


@contextlib.contextmanager
def busy_neighbour(fraction: float) -> Iterator[None]:
    """Another process keeping one core busy `fraction` of the time while the block runs (none at 0)."""
    if fraction <= 0:
        yield
        return
    neighbour = multiprocessing.Process(target=keep_busy, args=(fraction,), daemon=True)
    neighbour.start()
    try:
        yield
    finally:
        neighbour.kill()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="1,8,16,32,64")
    ap.add_argument("--prompt-len", type=int, default=180)
    ap.add_argument("--rounds", type=int, default=12)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--background-load", type=float, default=0.0, help="another process busy this fraction of a core")
    args = ap.parse_args()
    configure_torch(args.threads, EngineConfig().seed)  # once, for every engine of the process
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    rng = random.Random(0)
    engines = []
    for b in sizes:
        like = engines[0] if engines else None
        engines.append(filled_engine(b, max(sizes), args.prompt_len, like, rng, args.threads))
    times: dict[int, list[float]] = {b: [] for b in sizes}
    splits: dict[int, list[StepTimings]] = {b: [] for b in sizes}
    with busy_neighbour(args.background_load):
        for _ in range(args.rounds):
            for b, engine in zip(sizes, engines, strict=True):
                start = time.perf_counter()
                engine.step()
                times[b].append(time.perf_counter() - start)
                splits[b].append(engine.last_timings)
    phases = ("schedule", "prepare", "forward", "sample", "output")
    print(
        f"{'':6s} {'step ms':>8s} {'mean ms':>8s} {'tok/s':>7s} {'ms/seq':>6s} | "
        + " ".join(f"{p:>8s}" for p in phases)
        + "  host"
    )
    for b in sizes:
        step = statistics.median(times[b])
        parts = [statistics.median(getattr(t, f"{p}_s") for t in splits[b]) for p in phases]
        host = sum(parts) - parts[2]
        print(
            f"B={b:4d} {step * 1e3:8.1f} {statistics.mean(times[b]) * 1e3:8.1f} {b / step:7.1f} {step / b * 1e3:6.2f} | "
            + " ".join(f"{x * 1e3:8.2f}" for x in parts)
            + f"  {host / sum(parts):5.1%}"
        )


if __name__ == "__main__":
    main()
