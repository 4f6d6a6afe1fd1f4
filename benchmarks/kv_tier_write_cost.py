"""What writing to the disk KV tier costs a block, in CPU time, which a host loaded by others disturbs far less than
wall time: the step's share (the main thread's time in BlockWriter.save: handing the saves over; before the writer
read the pool, the copy out of it) and the writer thread's (checksum and write), per block written. Unique 256-token prompts x 16 tokens on the default model (or
--model), every full block written; rounds after the first two (warm allocator, warm directory) are counted.

    .venv/bin/python benchmarks/kv_tier_write_cost.py [--dtype bfloat16] [--rounds 5]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchserve.engine.llm_engine import LLMEngine  # noqa: E402
from batchserve.sampling_params import SamplingParams  # noqa: E402


def thread_cpu_s(name: str) -> float:
    """A thread's CPU seconds so far (Linux: /proc)."""
    (thread,) = [t for t in threading.enumerate() if t.name == name]
    fields = Path(f"/proc/self/task/{thread.native_id}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tier_dir:
        options = dict(model=args.model, device="cpu", dtype=args.dtype, block_size=16, num_kv_blocks=1024,
                       max_batch_size=16, max_num_tokens=2048, kv_offload_dir=tier_dir)  # fmt: skip
        engine = LLMEngine.from_options(**{k: v for k, v in options.items() if v is not None})
        writer, step_share = engine.runner.offload, [0.0]
        save = writer.save

        def timed_save(*save_args):  # (saves), or (kv_cache, saves) in a checkout from before the writer read the pool
            start = time.thread_time()
            save(*save_args)
            step_share[0] += time.thread_time() - start

        writer.save = timed_save
        rng, params = random.Random(2), SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        for round_ in range(args.rounds):
            if round_ == min(2, args.rounds - 1):
                writer.flush()
                step_share[0], blocks, writer_s = (
                    0.0,
                    engine.kv_tier.stats.blocks_written,
                    thread_cpu_s("kv-tier-write"),
                )
            for _ in range(12):
                engine.add_prompt(None, [rng.randrange(10, 20000) for _ in range(256)], params)
            while engine.has_unfinished_requests():
                engine.step()
        writer.flush()
        n = engine.kv_tier.stats.blocks_written - blocks
        print(f"{args.dtype}: {n} blocks written; CPU a block: the step's end {step_share[0] / n * 1e3:.3f} ms, the "
              f"writer thread {(thread_cpu_s('kv-tier-write') - writer_s) / n * 1e3:.3f} ms")  # fmt: skip
        engine.close()


if __name__ == "__main__":
    main()
