"""Where a fresh prompt's prefill attention should change path: the native prefill kernel (all prompts in one call)
against torch's SDPA (one call per prompt, AMX tiles for a bf16 pool), ms per prompt at each prompt length.

    .venv/bin/python benchmarks/prefill_split.py                       # bf16 pool, SmolLM2-135M heads
    .venv/bin/python benchmarks/prefill_split.py --threads 2            # as the engine runs it
    .venv/bin/python benchmarks/prefill_split.py --lengths 16,64,256 --tokens 8192
    .venv/bin/python benchmarks/prefill_split.py --kernels avx512,avx512_bf16   # two prefill kernel paths in turns

One call = one layer's attention of `--tokens` tokens of fresh prompts of one length (so `tokens / length` prompts),
9 query heads over 3 kv heads of dim 64, blocks of 16 tokens, this step's K/V already in the pool. Both paths run in
turns on the same inputs, so a change of the host's load hits both alike; prints the median ms per prompt (CPU time
of this process, 1 thread by default: a shared host's other jobs count less; wall time beside it) and the ratio of the
CPU times. Run it with the engine's threads too (`--threads 2`): there each SDPA call is a parallel region of its own,
which is what short prompts pay for. `paths.SHORT_PREFILL_MAX_ROWS` is the longest length at which the native kernel
stays clearly ahead with the engine's threads (docs/cpu-kernels.md, prefill attention by chunk length).
`--kernels` names the native prefill kernel paths of a bf16 pool to run in turns (default: the one this host chooses,
which BATCHSERVE_PREFILL_KERNEL_PATH forces); each is called as the engine calls it (bf16 queries to a tile kernel).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from batchserve.bench.machine import describe, machine_info
from batchserve.layers import kernels
from batchserve.layers.kernels import paths


def make_step(length: int, prompts: int, heads: int, kv_heads: int, head_dim: int, block_size: int):
    """Queries, this step's K/V and a pool holding them, for `prompts` fresh prompts of `length` tokens."""
    torch.manual_seed(length)
    tokens = length * prompts
    per_seq = -(-length // block_size)
    pool_shape = (prompts * per_seq, block_size, kv_heads, head_dim)
    key_cache = torch.randn(pool_shape).bfloat16()
    value_cache = torch.randn(pool_shape).bfloat16()
    tables = torch.arange(prompts * per_seq).view(prompts, per_seq)
    # this step's K/V are the pool's first `length` slots of each prompt's blocks
    slots = (tables[:, :, None] * block_size + torch.arange(block_size)).view(prompts, -1)[:, :length].reshape(-1)
    key = key_cache.view(-1, kv_heads, head_dim)[slots]
    value = value_cache.view(-1, kv_heads, head_dim)[slots]
    query = torch.randn(tokens, heads, head_dim).bfloat16()
    lens = torch.full((prompts,), length)
    starts = torch.arange(prompts + 1) * length
    return query, key, value, key_cache, value_cache, tables, lens, starts


def native(step, native_mod, path, kernel, scale):
    query, _, _, key_cache, value_cache, tables, lens, starts = step
    rows = query if kernel.name != "avx512" else query.float()  # the engine's rule (layers/attention.py)
    native_mod.paged_prefill_attention(rows, key_cache, value_cache, tables, lens, starts, scale, path, kernel)


def sdpa(step, length, scale):
    query, key, value = step[:3]
    for start in range(0, query.shape[0], length):
        q, k, v = (t[start : start + length].transpose(0, 1).unsqueeze(0) for t in (query, key, value))
        F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)


def timed(fn, *args) -> tuple[float, float]:
    """ms of CPU time of this process and of wall time that fn(*args) took."""
    start, start_wall = time.process_time(), time.perf_counter()
    fn(*args)
    return (time.process_time() - start) * 1e3, (time.perf_counter() - start_wall) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="8,16,32,64,128,256,512")
    ap.add_argument("--tokens", type=int, default=4096, help="tokens per call (prompts = tokens / length)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--kernels", default="", help="prefill kernel paths in turns, e.g. avx512,avx512_bf16")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native_mod = kernels.load()
    if native_mod is None or not native_mod.prefill_attention_available(64):
        raise SystemExit("the native prefill kernel is not built here")
    path = kernels.attention_path()
    names = args.kernels.split(",") if args.kernels else [kernels.prefill_kernel_path() or "avx512"]
    for name in names:
        if not kernels.prefill_kernel_path_runs(name):
            raise SystemExit(f"prefill kernel path {name} is not built here or does not run on this CPU")
    isa = {name: native_mod.Isa.__members__[paths.OPERATIONS["prefill_attention"].path(name).isa] for name in names}
    print(describe(machine_info(threads=args.threads)))
    print(f"load average (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}; attention path {path.name}")
    print("ms per prompt, median of the rounds: CPU time (wall time); sdpa/kernel: the CPU times' ratio")
    print(
        f"{'length':>6s} {'prompts':>7s} " + " ".join(f"{n:>17s} {'sdpa/' + n:>18s}" for n in names) + f" {'sdpa':>17s}"
    )
    scale = 64**-0.5
    for length in (int(n) for n in args.lengths.split(",")):
        prompts = max(1, args.tokens // length)
        step = make_step(length, prompts, 9, 3, 64, 16)
        runs = {name: [] for name in [*names, "sdpa"]}
        for _ in range(args.rounds):
            for name in names:
                runs[name].append(timed(native, step, native_mod, path, isa[name], scale))
            runs["sdpa"].append(timed(sdpa, step, length, scale))
        median = {k: [statistics.median(t) / prompts for t in zip(*runs[k])] for k in runs}
        s, s_wall = median["sdpa"]
        cells = " ".join(f"{median[n][0]:8.4f} ({median[n][1]:6.4f}) {s / median[n][0]:18.2f}" for n in names)
        print(f"{length:6d} {prompts:7d} {cells} {s:8.4f} ({s_wall:6.4f})")


if __name__ == "__main__":
    main()
