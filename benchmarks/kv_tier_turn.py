"""Where a tier-served turn's time goes: a conversation's history (H tokens) is evicted from the pool, then the next
turn (the history and N new tokens) finds it in the disk tier. Per phase, medians over interleaved repetitions: the
scheduler's step (it waits there for the read, nothing else running), the read alone (blocks into the pool), the
forward pass, sampling; for two ways of reading the same blocks back, alternating turn by turn so that a host's
load falls on all alike:

- one reader:  the reader thread alone reads each file straight into its pool block's rows and checks it there;
- two readers: a second thread takes blocks of the same job beside it (the engine's way when it computes on two
               cores or more);

    .venv/bin/python benchmarks/kv_tier_turn.py [--history 1167] [--new 257] [--reps 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchserve.engine.llm_engine import LLMEngine  # noqa: E402
from batchserve.host.process import configure_torch  # noqa: E402
from batchserve.sampling_params import SamplingParams  # noqa: E402

WAYS = ("one reader", "two readers")


def set_way(engine: LLMEngine, way: str) -> None:
    offload = engine.kv_tier
    if offload._helpers is None:  # an engine given one core has no second reader: this run gets one
        offload._helpers = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-tier-read-more")
    offload.readers = 1 if way == "one reader" else 2


def serve(engine: LLMEngine, prompt: list[int]) -> dict[str, float]:
    """One request to its first token; seconds per phase."""
    phases = dict.fromkeys(("ttft", "schedule", "read", "prepare", "forward", "sample"), 0.0)
    stats = engine.kv_tier.stats
    read_before = stats.read_s
    start = time.perf_counter()
    engine.add_prompt(None, prompt, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    schedule = engine.scheduler.schedule

    def timed_schedule():
        began = time.perf_counter()
        out = schedule()
        phases["schedule"] += time.perf_counter() - began
        return out

    engine.scheduler.schedule = timed_schedule
    while engine.has_unfinished_requests():
        engine.step()
        timings = engine.runner.last_timings
        phases["prepare"] += timings.prepare_s
        phases["forward"] += timings.forward_s
        phases["sample"] += timings.sample_s
    del engine.scheduler.schedule
    phases["ttft"] = time.perf_counter() - start
    phases["read"] = stats.read_s - read_before  # read + check, summed over the threads that read
    return phases


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--history", type=int, default=1167, help="tokens found in the tier")
    parser.add_argument("--new", type=int, default=257, help="tokens computed after them")
    parser.add_argument("--reps", type=int, default=5, help="turns per way of reading")
    args = parser.parse_args()
    configure_torch(args.threads, 0)
    blocks = -(-(args.history + args.new) // 16) + 2  # one turn fits
    options = dict(model=args.model, device="cpu", dtype=args.dtype, block_size=16, num_kv_blocks=blocks,
                   max_batch_size=16, max_num_tokens=4096, num_threads=args.threads)  # fmt: skip
    with tempfile.TemporaryDirectory() as tier_dir:
        engine = LLMEngine.from_options(kv_offload_dir=tier_dir, **{k: v for k, v in options.items() if v is not None})
        rng = random.Random(0)
        vocab = engine.model_config.vocab_size

        def tokens(n: int) -> list[int]:
            return [rng.randrange(10, vocab) for _ in range(n)]

        serve(engine, tokens(50))  # warm-up
        results: dict[str, list[dict[str, float]]] = {way: [] for way in WAYS}
        for rep in range(args.reps):
            for way in WAYS if rep % 2 else reversed(WAYS):
                history = tokens(args.history)
                serve(engine, history)
                engine.runner.offload.flush()
                serve(engine, tokens(blocks * 16 - 8))  # takes every block: the history is evicted from the pool
                engine.runner.offload.flush()
                set_way(engine, way)
                hits = engine.kv_tier.stats.hits
                results[way].append(serve(engine, history + tokens(args.new)))
                assert engine.kv_tier.stats.hits - hits == args.history // 16, "the history was not read back"
        engine.close()
    print(f"{args.dtype}, {args.threads or 'default'} threads; {args.history} tokens read back "
          f"({args.history // 16} blocks), {args.new} computed; medians of {args.reps} (ms):")  # fmt: skip
    print(f"{'':11}" + "".join(f"{p:>10}" for p in results[WAYS[0]][0]))
    for way, runs in results.items():
        print(f"{way:11}" + "".join(f"{statistics.median(r[p] for r in runs) * 1e3:10.1f}" for p in runs[0]))


if __name__ == "__main__":
    main()
