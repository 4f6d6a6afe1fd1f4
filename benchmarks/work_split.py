"""The decode work scheduler (kernels/work_split.h) on mixed context lengths: ms per paged decode attention call on
each attention path, at batch 1 and batch 32, with --threads threads (default 2). Batch 32 holds a few long contexts
among many short ones, oldest (longest) first as the engine lists them: the case where a static split of the items
leaves one thread the long contexts. Run it once per build to compare schedulers (the build folder and the source tree
decide which kernels load), alternating the runs on a shared host:

    PYTHONPATH=. .venv/bin/python benchmarks/work_split.py [--threads 2] [--rounds 40] [--library OLD.so]

--library loads a built kernels library directly (another checkout's, copied out of its build folder), so that two
builds are compared with one script.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchserve.layers import kernels  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16  # SmolLM2-135M's attention


def mixed_lengths(batch: int, seed: int = 0) -> list[int]:
    """One long context for a batch of 1; for more, an eighth of them long (1500-3000 tokens), the rest short (32-400),
    longest first."""
    rng = random.Random(seed)
    if batch == 1:
        return [2000]
    long = [rng.randint(1500, 3000) for _ in range(max(1, batch // 8))]
    short = [rng.randint(32, 400) for _ in range(batch - len(long))]
    return sorted(long + short, reverse=True)


def make_batch(lens: list[int], dtype: torch.dtype):
    per_seq = [-(-n // BLOCK) for n in lens]
    num_blocks = sum(per_seq) + 4
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1)).tolist()
    tables = torch.zeros(len(lens), max(per_seq), dtype=torch.int64)
    for s, n in enumerate(per_seq):
        tables[s, :n] = torch.tensor([order.pop() for _ in range(n)])
    shape = (num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    key, value = torch.randn(shape).to(dtype), torch.randn(shape).to(dtype)
    query = torch.randn(len(lens), HEADS, HEAD_DIM)
    return query, key, value, tables, torch.tensor(lens)


def load_library(path: str):
    """A kernels library file loaded as the Python module it is (named as its file)."""
    name = Path(path).name.split(".")[0]
    loader = importlib.machinery.ExtensionFileLoader(name, path)
    module = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--calls", type=int, default=10, help="calls per timing (default: %(default)s)")
    ap.add_argument("--library", default=None, help="a built kernels library (.so) to load instead of this tree's")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native = load_library(args.library) if args.library else kernels.load()
    assert native is not None, "native kernels not built here"
    paths = [p for p in kernels.ATTENTION_PATHS if native.attention_path_runs(native.AttentionPath.__members__[p])]
    print(f"{Path(native.__file__).parent.name}: {args.threads} threads, load average {os.getloadavg()[0]:.1f}")
    print(f"{'batch':>5s} {'pool':9s} {'path':12s} {'median ms':>10s} {'best ms':>8s}")
    for batch in (1, 32):
        for dtype in (torch.float32, torch.bfloat16):
            query, key, value, tables, lens = make_batch(mixed_lengths(batch), dtype)
            for path in paths:
                if path == "avx512_bf16" and dtype != torch.bfloat16:
                    continue
                isa = native.AttentionPath.__members__[path]
                native.paged_decode_attention(query, key, value, tables, lens, HEAD_DIM**-0.5, isa)
                samples = []
                for _ in range(args.rounds):
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        native.paged_decode_attention(query, key, value, tables, lens, HEAD_DIM**-0.5, isa)
                    samples.append((time.perf_counter() - start) / args.calls * 1e3)
                name = str(dtype).removeprefix("torch.")
                print(f"{batch:5d} {name:9s} {path:12s} {statistics.median(samples):10.3f} {min(samples):8.3f}")


if __name__ == "__main__":
    main()
