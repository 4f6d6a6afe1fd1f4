"""What this machine's matmuls allow: the best possible decode tok/s of SmolLM2-135M at batch sizes M.

    .venv/bin/python benchmarks/roofline.py                    # float32 and bfloat16, 2 threads, M in 1 16 64 128 256
    .venv/bin/python benchmarks/roofline.py --dtypes float32 --ms 1,64 --threads 2

Times torch.matmul for each linear layer shape of the model (the faster of x @ W.T and x @ W) at M tokens, over
30 distinct weight copies per shape (as in the real model, so a layer's weights are not still in cache from the run
before), plus the lm_head. One decode step of M sequences = the sum over the 30 layers of their matmuls at M + the
lm_head at M, so the best decode tok/s at M = M / that time. Attention, norms, RoPE, sampling and Python overhead
are left out: a real engine can only be slower. FLOPs per token = 2 * params touched per token (incl. lm_head).
Prints a table and saves JSON and a PNG (matplotlib) to bench_results/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from batchserve.bench.machine import describe, machine_info

RESULTS = Path(__file__).resolve().parent.parent / "bench_results"

# SmolLM2-135M: hidden 576, intermediate 1536, 9 heads / 3 KV heads of dim 64, 30 layers, vocab 49152 (tied).
HIDDEN, INTERMEDIATE, HEAD_DIM, HEADS, KV_HEADS, LAYERS, VOCAB = 576, 1536, 64, 9, 3, 30, 49152
LAYER_SHAPES = {  # name: (in K, out N), applied once per layer per token
    "qkv": (HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM),  # 576 -> 960
    "o": (HEADS * HEAD_DIM, HIDDEN),  # 576 -> 576
    "gate_up": (HIDDEN, 2 * INTERMEDIATE),  # 576 -> 3072
    "down": (INTERMEDIATE, HIDDEN),  # 1536 -> 576
}
LM_HEAD = (HIDDEN, VOCAB)  # 576 -> 49152, once per token
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def params_per_token() -> int:
    return LAYERS * sum(k * n for k, n in LAYER_SHAPES.values()) + LM_HEAD[0] * LM_HEAD[1]


def time_matmuls(
    m: int, shape: tuple[int, int], copies: int, dtype: torch.dtype, min_time: float, clock=time.perf_counter
) -> float:
    """Median seconds for one (m, K) x (K, N) product, cycling through `copies` distinct weights; the faster of the
    two weight layouts ([N, K] as x @ W.T, the nn.Linear way, or [K, N] as x @ W), since an engine may keep either.
    `clock` time.process_time on one thread: CPU seconds, which a loaded host does not inflate."""
    k, n = shape
    weights = [torch.randn(n, k, dtype=dtype) * 0.02 for _ in range(copies)]
    x = torch.randn(m, k, dtype=dtype)
    products = [(torch.matmul, [w.t() for w in weights]), (torch.matmul, [w.t().contiguous() for w in weights])]
    packed = _packed(weights)
    if packed:
        products.append((lambda a, w: torch.ops.mkldnn._linear_pointwise(a, w, None, "none", [], ""), packed))
    best = float("inf")
    with torch.inference_mode():
        for product, operands in products:
            for w in operands:  # warm-up: first touch, kernel selection
                product(x, w)
            samples: list[float] = []
            start = time.perf_counter()
            while len(samples) < 3 or (time.perf_counter() - start < min_time and len(samples) < 200):
                t0 = clock()
                for w in operands:
                    product(x, w)
                samples.append((clock() - t0) / copies)
            best = min(best, statistics.median(samples))
    return best


def _packed(weights: list[torch.Tensor]) -> list[torch.Tensor]:
    """oneDNN's packed copies (the layout batchserve's CpuLinear keeps), or [] where this torch has none."""
    try:
        return [torch.ops.mkldnn._reorder_linear_weight(w, None) for w in weights]
    except (AttributeError, RuntimeError):
        return []


def workload_bound(rows: list[dict], workload: Path, batch: int) -> dict[str, dict]:
    """The matmul-only time of a whole workload, per dtype: every prompt token at the largest M's rate (prefill runs
    in big chunks), every output token at the rate of M = min(batch, requests) (all decoding together: optimistic,
    so a real run can only take longer)."""
    requests = json.loads(workload.read_text())["requests"]
    prompt = sum(len(r["prompt_token_ids"]) for r in requests)
    output = sum(r["max_tokens"] for r in requests)
    decode_m = min(batch, len(requests))
    bounds = {}
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        mine = {r["M"]: r for r in rows if r["dtype"] == dtype}
        per_token = {m: r["step_s"] / m for m, r in mine.items()}
        prefill_s = prompt * per_token[max(mine)]
        decode_s = output * per_token[min(mine, key=lambda m: abs(m - decode_m))]
        bounds[dtype] = {"prompt_tokens": prompt, "output_tokens": output, "bound_s": prefill_s + decode_s,
                         "bound_output_tok_s": output / (prefill_s + decode_s)}  # fmt: skip
    return bounds


def kv_bytes_per_token(element: int) -> int:
    """K and V of one token of context, every layer: what decode attention reads per token it attends to."""
    return 2 * LAYERS * KV_HEADS * HEAD_DIM * element


def _matmul_s(mine: dict[int, dict], name: str, m: int) -> float:
    """Seconds of one `name` matmul at m rows: linear between the measured Ms around m (time grows slower than M, so
    the chord is below the curve: never more than the real time), zero at 0 rows, past the largest M at its per-row
    rate."""
    if m <= 0:
        return 0.0
    ms = sorted(mine)
    if m >= ms[-1]:
        return mine[ms[-1]]["matmul_s"][name] * m / ms[-1]
    high = next(x for x in ms if x >= m)
    low = max((x for x in ms if x < m), default=0)
    t_low = mine[low]["matmul_s"][name] if low else 0.0
    return t_low + (mine[high]["matmul_s"][name] - t_low) * (m - low) / (high - low)


def step_roofline(rows: list[dict], dtype_name: str, steps: list[tuple[int, int, int]], bandwidth: float) -> dict:
    """The least time a run of engine steps could take: per step (rows through the layers, rows through the
    lm_head, tokens of K/V attention reads) the larger of its matmul time at the rates measured in `rows` and the
    bytes it must read (every weight once, the K/V) at `bandwidth` bytes/s. Attention's FLOPs, norms and the host's
    work are left out: a real engine can only take longer."""
    mine = {r["M"]: r for r in rows if r["dtype"] == dtype_name}
    element = torch.empty((), dtype=DTYPES[dtype_name]).element_size()
    total = compute_s = memory_s = 0.0
    compute_bound = 0
    for tokens, sampled, kv_tokens in steps:
        matmul = LAYERS * sum(_matmul_s(mine, n, tokens) for n in LAYER_SHAPES) + _matmul_s(mine, "lm_head", sampled)
        memory = (params_per_token() * element + kv_tokens * kv_bytes_per_token(element)) / bandwidth
        total += max(matmul, memory)
        compute_s, memory_s = compute_s + matmul, memory_s + memory
        compute_bound += matmul >= memory
    return {"bound_s": total, "matmul_s": compute_s, "memory_s": memory_s, "steps": len(steps),
            "compute_bound_steps": compute_bound}  # fmt: skip


def measure(dtype_name: str, ms: list[int], min_time: float, clock=time.perf_counter) -> list[dict]:
    dtype = DTYPES[dtype_name]
    flops_per_token = 2 * params_per_token()
    rows = []
    for m in ms:
        per_shape = {}
        for name, shape in LAYER_SHAPES.items():
            per_shape[name] = time_matmuls(m, shape, LAYERS, dtype, min_time, clock)
        per_shape["lm_head"] = time_matmuls(m, LM_HEAD, 1, dtype, min_time, clock)
        step_s = LAYERS * sum(per_shape[name] for name in LAYER_SHAPES) + per_shape["lm_head"]
        gflops = {
            name: 2 * m * k * n / per_shape[name] / 1e9
            for name, (k, n) in [*LAYER_SHAPES.items(), ("lm_head", LM_HEAD)]
        }
        rows.append(
            {
                "dtype": dtype_name,
                "M": m,
                "matmul_s": per_shape,
                "gflops": gflops,
                "step_s": step_s,
                "model_gflops": flops_per_token * m / step_s / 1e9,
                "best_decode_tok_s": m / step_s,
            }
        )
        print(
            f"{dtype_name:<9} M={m:<4} step {1e3 * step_s:8.2f} ms  {rows[-1]['model_gflops']:7.1f} GFLOP/s  "
            f"best decode {rows[-1]['best_decode_tok_s']:8.1f} tok/s",
            flush=True,
        )
    return rows


def table(rows: list[dict]) -> list[str]:
    names = [*LAYER_SHAPES, "lm_head"]
    head = f"{'dtype':<9} {'M':>4} " + " ".join(f"{n:>8}" for n in names) + f" {'model':>8} {'step ms':>8} {'tok/s':>9}"
    lines = ["GFLOP/s per matmul shape, whole-model GFLOP/s, time of one decode step, best decode tok/s", head]
    lines.append("-" * len(head))
    for r in rows:
        lines.append(
            f"{r['dtype']:<9} {r['M']:>4} "
            + " ".join(f"{r['gflops'][n]:>8.1f}" for n in names)
            + f" {r['model_gflops']:>8.1f} {1e3 * r['step_s']:>8.2f} {r['best_decode_tok_s']:>9.1f}"
        )
    return lines


def plot(rows: list[dict], path: Path, threads: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        mine = [r for r in rows if r["dtype"] == dtype]
        ms = [r["M"] for r in mine]
        left.plot(ms, [r["best_decode_tok_s"] for r in mine], marker="o", label=dtype)
        for name in [*LAYER_SHAPES, "lm_head"]:
            style = "-" if dtype == "float32" else "--"
            right.plot(ms, [r["gflops"][name] for r in mine], style, marker=".", label=f"{name} {dtype}")
    left.set(
        xscale="log",
        yscale="log",
        xlabel="sequences per decode step (M)",
        ylabel="best decode tok/s",
        title=f"SmolLM2-135M decode bound from matmul time ({threads} threads)",
    )
    right.set(xscale="log", xlabel="tokens per matmul (M)", ylabel="GFLOP/s", title="torch.matmul GFLOP/s per shape")
    for ax in (left, right):
        ax.grid(True, which="both", alpha=0.3)
    left.legend()
    right.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--ms", default="1,16,64,128,256,512", help="comma-separated token counts per step")
    ap.add_argument(
        "--workload",
        type=Path,
        default=Path(__file__).resolve().parent / "workloads" / "peer64.json",
        help="also give the matmul-only bound of this workload (benchmarks/peer_compare.py's)",
    )
    ap.add_argument("--batch", type=int, default=64, help="sequences decoding together in that workload")
    ap.add_argument("--min-time", type=float, default=0.3, help="seconds of samples per measurement (at least 3)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ms = [int(m) for m in args.ms.split(",")]
    dtypes = [d.strip() for d in args.dtypes.split(",")]
    load_before = os.getloadavg()
    print(
        f"{params_per_token() / 1e6:.1f} M params touched per token, {2 * params_per_token() / 1e6:.0f} MFLOP/token; "
        f"threads {torch.get_num_threads()}; load average before {load_before[0]:.2f}",
        flush=True,
    )
    rows = [row for d in dtypes for row in measure(d, ms, args.min_time)]
    load_after = os.getloadavg()
    lines = table(rows)
    bounds = workload_bound(rows, args.workload, args.batch)
    for dtype, b in bounds.items():
        lines.append(
            f"{args.workload.name} ({b['prompt_tokens']} prompt + {b['output_tokens']} output tokens), {dtype}: "
            f"matmul-only bound {b['bound_s']:.1f} s = {b['bound_output_tok_s']:.0f} output tok/s"
        )
    lines.insert(0, f"machine: {describe(machine_info(args.threads))}")
    print("\n" + "\n".join(lines))
    print(f"load average before {load_before[0]:.2f} / after {load_after[0]:.2f} (1-min)")
    RESULTS.mkdir(exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    record = {
        "threads": args.threads,
        "params_per_token": params_per_token(),
        "flops_per_token": 2 * params_per_token(),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "torch": torch.__version__,
        "machine": machine_info(args.threads),
        "workload_bounds": bounds,
        "table": lines,
        "rows": rows,
    }
    (RESULTS / f"roofline-{stamp}.json").write_text(json.dumps(record, indent=1))
    png = RESULTS / f"roofline-{stamp}.png"
    plot(rows, png, args.threads)
    print(f"saved {RESULTS / f'roofline-{stamp}.json'} and {png}")


if __name__ == "__main__":
    main()
