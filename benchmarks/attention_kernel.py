"""The native paged decode attention kernel alone, per path: ms per call at decode-batch shapes.

    .venv/bin/python benchmarks/attention_kernel.py                      # 64 seqs x ~300 tokens, SmolLM2-135M heads
    .venv/bin/python benchmarks/attention_kernel.py --copies 12          # K/V from DRAM, as in a 30-layer model
    .venv/bin/python benchmarks/attention_kernel.py --paths avx512_bf16,avx512 --layout contiguous
    .venv/bin/python benchmarks/attention_kernel.py --seqs 1 --context 8000 --copies 30 --pages 4k,2m
    PYTHONPATH=. .venv/bin/python benchmarks/attention_kernel.py --context-range 50,550 --layout interleaved \
        --copies 30 --stream                                              # peer64's decode steps

One call = one layer's decode attention of the whole batch: `--seqs` sequences of `--context` tokens (+-10%, so tiles
end at different places), 9 query heads over 3 kv heads of dim 64, blocks of 16 tokens (the engine's default) dealt
from a shuffled pool as a long-running engine leaves them (`--layout contiguous`: each sequence's blocks in a row, as
right after prefill; `--layout interleaved`: a prompt's blocks in a row, then the blocks decode adds dealt one a
sequence in turn, as the engine hands them out when every sequence of a batch grows by a block in the same steps).
`--context-range LO,HI` draws each sequence's context uniformly from LO..HI instead (peer64's decode steps see
50-550). `--copies N` cycles the calls through N copies of the pool, so that with N x the pool (7 MB in
bf16 at the defaults) beyond the last-level cache each call reads its K/V from memory, as each layer does in a
running engine. Each path runs on the same pools (bfloat16 and float32) in turns, so a change of the host's load hits
every path alike; `--pages 4k,2m` does the same with pools on 4 KiB pages and on 2 MiB ones (the default, as the
engine's pool lies where the host has transparent huge pages: host/huge_pages.py). Prints the median and best ms per
call (CPU time of this process with 1 thread: a shared host's other jobs count less; wall time with more), the GB/s
of the live K/V bytes a call reads, and the max difference from the float32-pool result, with the CPU, its path flags
and the load average. `--stream` adds what reading the same bytes without the maths takes (stream_read.c, 1 thread,
CPU time): a plain streaming read of as many bytes, and the pools' blocks read in the kernel's order with the next
block asked for ahead, the rate its access pattern allows.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import torch

from batchserve.bench.machine import describe, machine_info
from batchserve.host import huge_pages
from batchserve.layers import kernels


def block_tables(per_seq: list[int], layout: str, rng: random.Random) -> tuple[torch.Tensor, int]:
    """Each sequence's blocks of a pool of `per_seq` blocks (+8 spare) laid out as `layout` says."""
    num_blocks = sum(per_seq) + 8
    free = list(range(num_blocks))[::-1]  # popped from the end: 0, 1, 2, ...
    if layout == "shuffled":
        rng.shuffle(free)
    tables = torch.zeros(len(per_seq), max(per_seq), dtype=torch.int64)
    if layout == "interleaved":  # half of each context a prompt in a row, then one block a sequence in turn
        prompt = [max(1, n // 2) for n in per_seq]
        for s, n in enumerate(prompt):
            tables[s, :n] = torch.tensor([free.pop() for _ in range(n)])
        for b in range(max(per_seq)):
            for s, n in enumerate(per_seq):
                if prompt[s] <= b < n:
                    tables[s, b] = free.pop()
        return tables, num_blocks
    for s, n in enumerate(per_seq):
        tables[s, :n] = torch.tensor([free.pop() for _ in range(n)])
    return tables, num_blocks


def make_batch(
    seqs: int,
    context: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    seed: int = 0,
    layout: str = "shuffled",
    context_range: tuple[int, int] | None = None,
):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    if context_range:
        lens = [rng.randint(*context_range) for _ in range(seqs)]
    else:
        lens = [max(1, round(context * rng.uniform(0.9, 1.1))) for _ in range(seqs)]
    per_seq = [-(-n // block_size) for n in lens]
    tables, num_blocks = block_tables(per_seq, layout, rng)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    key, value = torch.randn(shape), torch.randn(shape)
    query = torch.randn(seqs, heads, head_dim).bfloat16().float()  # a bf16 model's query, as the kernel gets it
    return query, key, value, tables, torch.tensor(lens)


def on_pages(values: torch.Tensor, dtype: torch.dtype, pages: str) -> torch.Tensor:
    """A copy of `values` in `dtype` on 4 KiB pages ("4k": an ordinary tensor) or 2 MiB ones ("2m")."""
    if pages == "4k":
        return values.to(dtype, copy=True)
    assert pages == "2m", pages
    assert huge_pages.huge_pages_unavailable() is None, huge_pages.huge_pages_unavailable()
    out = huge_pages.zeros(values.shape, dtype)
    assert huge_pages.on_huge_pages(out), "the pool is too small for a mapping of its own"
    return out.copy_(values)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--context", type=int, default=300)
    ap.add_argument("--heads", default="9,3,64", help="query heads, kv heads, head dim (default: %(default)s)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--context-range", default=None, help="LO,HI: contexts drawn uniformly from LO..HI tokens")
    ap.add_argument("--layout", choices=("shuffled", "contiguous", "interleaved"), default="shuffled")
    ap.add_argument("--stream", action="store_true", help="also time a plain streaming read of the same bytes")
    ap.add_argument("--copies", type=int, default=1, help="pool copies the calls cycle through (default: %(default)s)")
    ap.add_argument("--paths", default=None, help="comma-separated; default: every path built and runnable here")
    ap.add_argument("--pages", default="2m", help="4k, 2m or both, comma-separated: the pools' pages (%(default)s)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native = kernels.load()
    assert native is not None, "native kernels not built here"
    heads, kv_heads, head_dim = (int(x) for x in args.heads.split(","))
    context_range = tuple(int(x) for x in args.context_range.split(",")) if args.context_range else None
    query, key, value, tables, lens = make_batch(
        args.seqs, args.context, heads, kv_heads, head_dim, args.block_size, layout=args.layout,
        context_range=context_range,
    )  # fmt: skip
    kv_values = 2 * int(lens.sum()) * kv_heads * head_dim  # the K and V a call reads
    scale = head_dim**-0.5
    built = getattr(native, "attention_paths", None)
    if built is None:  # a build from before paths existed: its one path
        paths = ["default"]
    else:
        paths = (
            args.paths.split(",")
            if args.paths
            else [p for p in kernels.ATTENTION_PATHS if kernels.attention_path_runs(p)]
        )

    def call(path: str, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if path == "default":
            return native.paged_decode_attention(query, k, v, tables, lens, scale)
        return native.paged_decode_attention(query, k, v, tables, lens, scale, native.AttentionPath.__members__[path])

    pools = {
        f"{dtype_name}/{pages}": [
            (on_pages(key, dtype, pages), on_pages(value, dtype, pages)) for _ in range(args.copies)
        ]
        for dtype_name, dtype in (("bfloat16", torch.bfloat16), ("float32", torch.float32))
        for pages in args.pages.split(",")
    }
    exact = call(paths[-1] if "portable" in paths else paths[0], key, value)
    times: dict[tuple[str, str], list[float]] = {(d, p): [] for d in pools for p in paths}
    error: dict[tuple[str, str], float] = {}
    for dtype, path in times:  # warm-up, and each path's distance from the float32 result
        error[dtype, path] = (call(path, *pools[dtype][0]) - exact).abs().max().item()
    clock = time.process_time if args.threads == 1 else time.perf_counter
    for _ in range(args.rounds):
        for dtype, path in times:
            start = clock()
            for pool in pools[dtype]:
                call(path, *pool)
            times[dtype, path].append((clock() - start) / args.copies)
    info = machine_info(threads=args.threads)
    print(describe(info))
    print(f"load average (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    contexts = f"{context_range[0]}-{context_range[1]}" if context_range else f"{args.context} (+-10%)"
    print(
        f"{args.seqs} seqs x {contexts} tokens, heads {heads}/{kv_heads}x{head_dim}, "
        f"block {args.block_size} ({args.layout}), {args.copies} pool copies, {args.rounds} rounds, "
        f"{'CPU' if args.threads == 1 else 'wall'} time"
    )
    print(f"{'pool':12s} {'path':12s} {'ms/call':>8s} {'min ms':>8s} {'GB/s':>6s} {'max |diff| vs f32 pool':>24s}")
    for (dtype, path), samples in times.items():
        call_bytes = kv_values * pools[dtype][0][0].element_size()
        print(
            f"{dtype:12s} {path:12s} {statistics.median(samples) * 1e3:8.3f} {min(samples) * 1e3:8.3f} "
            f"{call_bytes / statistics.median(samples) / 1e9:6.1f} {error[dtype, path]:24.2e}"
        )
    if args.stream:
        print_stream_rates(pools, tables, lens, args.rounds)


def kernel_runs(
    pool: tuple[torch.Tensor, torch.Tensor], tables: torch.Tensor, lens: torch.Tensor
) -> list[tuple[int, int]]:
    """(address, bytes) of each block's live rows a call reads, in the kernel's order: sequences longest first (the
    work queue's), each one's K blocks, then its V blocks."""
    runs = []
    block_size = pool[0].shape[1]
    row_bytes = pool[0][0, 0].numel() * pool[0].element_size()  # a token's kv heads
    for seq in sorted(range(len(lens)), key=lambda s: -int(lens[s])):
        for cache in pool:
            for start in range(0, int(lens[seq]), block_size):
                rows = min(block_size, int(lens[seq]) - start)
                block = int(tables[seq, start // block_size])
                runs.append((cache[block].data_ptr(), (rows * row_bytes + 127) // 128 * 128))
    return runs


def print_stream_rates(pools: dict, tables: torch.Tensor, lens: torch.Tensor, rounds: int) -> None:
    """Reading a call's bytes with no maths, 1 thread, CPU time: a plain streaming read of as many bytes as a round of
    calls reads, and the same blocks' live rows read in the kernel's order, the next block asked for into L2 as each
    starts (stream_read.c)."""
    import tempfile
    from pathlib import Path

    from stream_read import stream_library

    with tempfile.TemporaryDirectory() as folder:
        dll = stream_library(Path(folder))
        for name, copies in pools.items():
            runs = [run for pool in copies for run in kernel_runs(pool, tables, lens)]
            addrs = torch.tensor([a for a, _ in runs], dtype=torch.int64)
            sizes = torch.tensor([b for _, b in runs], dtype=torch.int64)
            nbytes = (int(sizes.sum()) + 255) // 256 * 256
            buf = dll.stream_buffer(nbytes, 1)
            repeats = max(5, rounds // 3)
            plain = statistics.median(dll.stream_read(buf, nbytes, 1, 1, 0) for _ in range(repeats))
            dll.stream_free(buf)
            blocks = {
                ahead: statistics.median(
                    dll.runs_read(addrs.data_ptr(), sizes.data_ptr(), len(runs), ahead) for _ in range(repeats)
                )
                for ahead in (0, 1)
            }
            print(f"{name:12s} read only: {plain:.1f} GB/s in a row, {blocks[1]:.1f} GB/s block by block in the "
                  f"kernel's order ({blocks[0]:.1f} without asking ahead), {nbytes / len(copies) / 1e6:.2f} MB a call")  # fmt: skip


if __name__ == "__main__":
    main()
