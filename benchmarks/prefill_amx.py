"""The native prefill kernel on AMX tiles against torch's SDPA (what a bfloat16 pool's prefill took on an AMX CPU
before it), one layer's attention, ms per call, and the ratio; `--kernels` runs other prefill kernel paths of a bf16
pool in turns with it (e.g. avx512_bf16,avx512 on an AVX512-BF16 CPU without AMX).

    .venv/bin/python benchmarks/prefill_amx.py                     # 1 thread, CPU time; 2k and 8k, head dims 64, 128
    .venv/bin/python benchmarks/prefill_amx.py --lengths 2048 --heads 9/3/64
    .venv/bin/python benchmarks/prefill_amx.py --kernels avx512_bf16,avx512 --heads 9/3/64
    .venv/bin/python benchmarks/prefill_amx.py --kernels avx512_bf16 --heads 9/3/64 --lengths none --after 30720:2048

Cases per head shape (query heads / kv heads / head dim):
- "fresh N": a whole prompt of N tokens (SDPA: one causal call on its own K/V, as the engine calls it);
- "after C: N": N rows after C cached keys, a later chunk of a long prompt or a prefix-cache hit (SDPA: one call over
  the sequence's keys gathered from the pool under the additive shifted causal mask, as the engine calls it);
- "short L x P": P prompts of L tokens in one step (SDPA: one call per prompt);
- `--after C:N` adds "after C: N" cases of its own (e.g. 30720:2048, the last chunk of a 32k prompt), and
  `--lengths none` leaves out the cases above, so that one long chunk is timed alone.
Both run in turns on the same inputs, so the host's load hits both alike; the median of the rounds of CPU time of this
process (1 thread by default; wall time beside it). A tile kernel's time includes packing the keys; it takes the
queries in bf16 (as the engine hands them), the vector kernel (avx512) in float32.
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


def make_case(
    seqs: list[tuple[int, int]],
    heads: int,
    kv_heads: int,
    head_dim: int,
    query_scale: float = 1.0,
    block_size: int = 16,
):
    """A pool holding sequences of (context, rows) tokens, their rows' queries (normal, times query_scale: the scores'
    spread), in block order."""
    torch.manual_seed(sum(c + r for c, r in seqs))
    lens = [c + r for c, r in seqs]
    per_seq = max(-(-n // block_size) for n in lens)
    shape = (len(seqs) * per_seq, block_size, kv_heads, head_dim)
    key_cache, value_cache = torch.randn(shape).bfloat16(), torch.randn(shape).bfloat16()
    tables = torch.arange(len(seqs) * per_seq).view(len(seqs), per_seq)
    rows = [r for _, r in seqs]
    query = (torch.randn(sum(rows), heads, head_dim) * query_scale).bfloat16()
    starts = torch.tensor([0, *rows]).cumsum(0)
    return {"seqs": seqs, "query": query, "key": key_cache, "value": value_cache, "tables": tables,
            "lens": torch.tensor(lens), "starts": starts, "block_size": block_size}  # fmt: skip


def kernel(case, native, isa, scale):
    args = (case["tables"], case["lens"], case["starts"], scale, kernels.attention_path(), isa)
    rows = case["query"] if isa.name != "avx512" else case["query"].float()  # the engine's rule (layers/attention.py)
    native.paged_prefill_attention(rows, case["key"], case["value"], *args)


def sdpa(case, scale):
    """As the engine's SDPA prefill does it: per sequence, its own K/V causal when fresh, else the pool's keys under
    the shifted causal mask."""
    kv_heads, head_dim, bs = case["key"].shape[2], case["key"].shape[3], case["block_size"]
    for i, (context, rows) in enumerate(case["seqs"]):
        start = int(case["starts"][i])
        q = case["query"][start : start + rows].transpose(0, 1).unsqueeze(0)
        n = context + rows
        blocks = case["tables"][i, : -(-n // bs)]
        k, v = (
            c[blocks].view(-1, kv_heads, head_dim)[:n].transpose(0, 1).unsqueeze(0)
            for c in (case["key"], case["value"])
        )
        if context == 0:
            F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = torch.zeros(rows, n, dtype=q.dtype).masked_fill_(
                torch.ones(rows, n, dtype=torch.bool).triu(context + 1), float("-inf")
            )
            F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)


def timed(fn, *args) -> tuple[float, float]:
    """ms of CPU time of this process and of wall time that fn(*args) took."""
    start, start_wall = time.process_time(), time.perf_counter()
    fn(*args)
    return (time.process_time() - start) * 1e3, (time.perf_counter() - start_wall) * 1e3


def cases(lengths: list[int], after: list[tuple[int, int]]) -> list[tuple[str, list[tuple[int, int]]]]:
    out = [(f"fresh {n}", [(0, n)]) for n in lengths]
    out += [(f"after {3 * n}: {n}", [(3 * n, n)]) for n in lengths if n <= 2048]
    if lengths:
        out += [("short 32 x 64", [(0, 32)] * 64), ("short 128 x 16", [(0, 128)] * 16)]
    return out + [(f"after {c}: {n}", [(c, n)]) for c, n in after]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", default="2048,8192", help="comma separated, or none")
    ap.add_argument("--after", default="", help="extra cases context:rows, comma separated (e.g. 30720:2048)")
    ap.add_argument("--heads", default="9/3/64,8/2/128", help="query heads/kv heads/head dim, comma separated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument(
        "--query-scale",
        type=float,
        default=1.0,
        help="queries times this: the scores' spread (1: a standard deviation of 1 after the scale)",
    )
    ap.add_argument("--no-sdpa", action="store_true", help="time the kernels only (SDPA takes long on long chunks)")
    ap.add_argument("--kernels", default="amx", help="prefill kernel paths in turns (amx, avx512_bf16, avx512)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    native = kernels.load()
    names = args.kernels.split(",")
    for name in names:
        if native is None or not kernels.prefill_kernel_path_runs(name):
            raise SystemExit(f"the {name} prefill kernel does not run here (not this CPU's, or no native kernels)")
    isa = {name: native.Isa.__members__[paths.OPERATIONS["prefill_attention"].path(name).isa] for name in names}
    print(describe(machine_info(threads=args.threads)))
    print(f"load average (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print("ms per call, median of the rounds: CPU time (wall time); sdpa/kernel: the CPU times' ratio")
    header = " ".join(f"{n:>17s} {'sdpa/' + n:>16s}" for n in names)
    print(f"{'heads':>9s} {'case':>18s} {header} {'sdpa':>17s}")
    for shape in args.heads.split(","):
        heads, kv_heads, head_dim = (int(x) for x in shape.split("/"))
        scale = head_dim**-0.5
        lengths = [] if args.lengths == "none" else [int(n) for n in args.lengths.split(",")]
        after = [tuple(int(x) for x in c.split(":")) for c in args.after.split(",") if c]
        for name, seqs in cases(lengths, after):
            case = make_case(seqs, heads, kv_heads, head_dim, args.query_scale)
            runs = {k: [] for k in [*names, "sdpa"]}
            for _ in range(args.rounds):
                for k in names:
                    runs[k].append(timed(kernel, case, native, isa[k], scale))
                runs["sdpa"].append((float("nan"),) * 2 if args.no_sdpa else timed(sdpa, case, scale))
            median = {k: [statistics.median(t) for t in zip(*runs[k])] for k in runs}
            s, s_wall = median["sdpa"]
            cells = " ".join(f"{median[k][0]:8.2f} ({median[k][1]:6.2f}) {s / median[k][0]:16.2f}" for k in names)
            print(f"{shape:>9s} {name:>18s} {cells} {s:8.2f} ({s_wall:6.2f})")


if __name__ == "__main__":
    main()
