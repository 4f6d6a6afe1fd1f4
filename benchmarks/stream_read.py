"""Where a batch-1 Q4_0 decode step's time goes on this host: the best streaming read rate against the rate at which
the W8A8 kernel streams each projection's weight bytes.

  stream   a plain AVX-512 read loop (stream_read.c, compiled here with the system C compiler) over --buffer-mib,
           on 1 and --threads threads, 4 KiB and transparent huge pages, without software prefetch and with the
           kernel's (into L2, 3 KiB ahead); GB/s of CPU time (each thread's clock), best of --repeats.
  q4       Llama-3.1-8B's projections at batch 1 as the engine runs them on a GGUF Q4_0 file (the int4 codes with
           float16 scales per 32, repacked for W8A8 at load; activation blocks of 16, the output projection's of
           32 and float32 out), --layers layers' worth so the weights stream from memory as in a step; per
           projection the median CPU time of a call on one thread and its GB/s of packed weight bytes.

    PYTHONPATH=. .venv/bin/python benchmarks/stream_read.py --what stream,q4 --threads 2
"""

from __future__ import annotations

import argparse
import ctypes
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "stream_read.c"
# (name, out, in) of Llama-3.1-8B: q/k/v fused, o, gate/up fused, down, and the output projection
PROJECTIONS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336))
LM_HEAD = ("lm_head", 128256, 4096)


def stream_library(folder: Path) -> ctypes.CDLL:
    lib = folder / "stream_read.so"
    subprocess.run(["cc", "-O2", "-mavx512f", "-pthread", "-shared", "-fPIC", str(SOURCE), "-o", str(lib)], check=True)
    dll = ctypes.CDLL(str(lib))
    dll.stream_buffer.restype = ctypes.c_void_p
    dll.stream_buffer.argtypes = [ctypes.c_size_t, ctypes.c_int]
    dll.stream_free.argtypes = [ctypes.c_void_p]
    dll.stream_read.restype = ctypes.c_double
    dll.stream_read.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_size_t]
    dll.runs_read.restype = ctypes.c_double
    dll.runs_read.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    return dll


def stream_rates(args) -> None:
    with tempfile.TemporaryDirectory() as folder:
        dll = stream_library(Path(folder))
        size = args.buffer_mib << 20
        print(f"streaming read of {args.buffer_mib} MiB, GB/s of CPU time (best / median of {args.repeats})")
        for huge in (0, 1):
            buf = dll.stream_buffer(size, huge)
            for threads in sorted({1, args.threads}):
                for ahead in (0, 3072):
                    rates = [dll.stream_read(buf, size, threads, 2, ahead) for _ in range(args.repeats)]
                    pages = "2 MiB" if huge else "4 KiB"
                    print(f"  {pages} pages, {threads} thread(s), prefetch {ahead or 'none':>4}: "
                          f"{max(rates):6.2f} / {statistics.median(rates):6.2f}", flush=True)  # fmt: skip
            dll.stream_free(buf)


def q4_projection(native, out: int, inp: int, float_output: bool):
    import torch

    from batchserve.layers import quantization

    codes = torch.randint(0, 256, (out, inp // 2), dtype=torch.uint8)
    scales = (torch.rand(out, inp // 32) * 0.01 + 0.001).half().float()
    return native.quantized_projection(
        codes, scales, 4, 32, None, path=quantization.W8A8_PATH, small_max_m=64, float_output=float_output,
        mins=None, bf16_tiles=False, act_block=32 if float_output else 16, amx_min_m=0, amx_emulated=False,
    )  # fmt: skip


def q4_rates(args) -> None:
    import torch

    from batchserve.layers import kernels

    native = kernels.load()
    torch.set_num_threads(1)
    layers = [
        [(name, k, n, q4_projection(native, n, k, False)) for name, n, k in PROJECTIONS] for _ in range(args.layers)
    ]
    head = (LM_HEAD[0], LM_HEAD[2], LM_HEAD[1], q4_projection(native, LM_HEAD[1], LM_HEAD[2], True))
    calls = [c for layer in layers for c in layer] + [head]
    inputs = {k: torch.randn(1, k).bfloat16() for _, k, _, _ in calls}
    seconds: dict[str, list[float]] = {}
    for step in range(args.steps + 1):
        for name, k, _, proj in calls:
            t0 = time.thread_time()
            proj(inputs[k])
            if step:  # the first step faults the packed weights' pages in
                seconds.setdefault(name, []).append(time.thread_time() - t0)
    print(f"Q4_0 W8A8 at batch 1, 1 thread, CPU clock, {args.layers} layers + lm_head, median of {args.steps} steps")
    total_s = total_bytes = 0.0
    for name, k, n, _ in [c for c in layers[0]] + [head]:
        per_step = args.layers if name != "lm_head" else 1
        packed = n * k // 2 + n * (k // 32) * 2
        s = statistics.median(seconds[name])
        spread = (min(seconds[name]), max(seconds[name]))
        total_s += s * per_step
        total_bytes += packed * per_step
        print(f"  {name:8} {n:>6}x{k:<6} {packed / 1e6:7.1f} MB  {1e3 * s:6.2f} ms "
              f"({1e3 * spread[0]:.2f}-{1e3 * spread[1]:.2f})  {packed / s / 1e9:5.2f} GB/s", flush=True)  # fmt: skip
    rate = total_bytes / total_s / 1e9
    print(f"  a step's projections: {1e3 * total_s:.2f} ms for {total_bytes / 1e6:.0f} MB, {rate:.2f} GB/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--what", default="stream,q4")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--buffer-mib", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    args = ap.parse_args()
    what = args.what.split(",")
    if "stream" in what:
        stream_rates(args)
    if "q4" in what:
        q4_rates(args)


if __name__ == "__main__":
    main()
