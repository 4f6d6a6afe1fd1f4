"""Where one decode step's time goes: the default model decodes after a --context-token prompt while `perf record`
samples this process, and the samples are summed into the step's parts (the weights' GEMMs, the decode attention,
everything else), each as a share of the step and in ms.

    PYTHONPATH=. .venv/bin/python benchmarks/step_profile.py --context 8000 --threads 1
    PYTHONPATH=. .venv/bin/python benchmarks/step_profile.py --workload benchmarks/workloads/peer64.json --dtype bfloat16

The step is timed by this process's CPU clock (with --threads 1) and the wall clock. Needs `perf` (Linux) with
permission to sample its own process; without it the step times alone are printed.

--workload: the default model runs a workload's requests at once on one thread (as `limits.py --sections peer64`),
and each step's CPU time is split by phase (scheduling, the runner's inputs, the decoder layers by op, the lm_head,
sampling, the outputs: step_timeline.py) for the prefill-carrying steps and for the decode-only steps by rows,
against each group's share of the step roofline (roofline.step_roofline: the layers' and the lm_head's GEMMs at
torch's rates at the step's M, timed here on the CPU clock, or the bytes at the measured bandwidth).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import limits  # noqa: E402
import roofline  # noqa: E402
import step_timeline  # noqa: E402

# step_timeline's ops (one table of symbols) -> the parts of a decode step; the other ops are "everything else"
PARTS = {"GEMMs": "weights' GEMMs", "decode attention": "decode attention"}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=120, help="decode steps timed (context + steps <= the model's)")
    ap.add_argument("--perf-seconds", type=float, default=2.5, help="how long perf samples (0: no perf)")
    ap.add_argument("--workload", type=Path, default=None, help="profile this workload's steps (e.g. peer64.json)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="with --workload")
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds of samples per GEMM timing (--workload)")
    ap.add_argument("--symbols", type=int, default=0, help="--workload: each part's N most sampled symbols")
    return ap.parse_args(argv)


def ready_engine(args):
    """An engine whose one sequence has prefilled --context tokens and decodes."""
    from batchserve.sampling_params import SamplingParams

    options = limits.parse_args(["--threads", str(args.threads)])
    engine = limits.new_engine(options, None, num_kv_blocks=(args.context + args.steps) // 16 + 16, max_batch_size=1,
                               max_model_len=args.context + args.steps + 16)  # fmt: skip
    params = SamplingParams(max_tokens=args.steps + 8, temperature=0.0, ignore_eos=True)
    engine.add_prompt("p", limits.prompt(engine.model_config.vocab_size, args.context, 10), params)
    while not any(o.delta_token_ids for o in engine.step()):
        pass
    return engine


def start_perf(seconds: float, output: Path) -> subprocess.Popen | None:
    if seconds <= 0 or not shutil.which("perf"):
        return None
    command = ["perf", "record", "-q", "-o", str(output), "-p", str(os.getpid()), "--", "sleep", str(seconds)]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def perf_parts(data: Path) -> dict[str, float]:
    """Each part's share of the samples, from `perf report` by symbol."""
    report = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "symbol", "--stdio", "-q"],
                            capture_output=True, text=True, check=False).stdout  # fmt: skip
    shares: dict[str, float] = {}
    for line in report.splitlines():
        fields = line.split(None, 2)
        if len(fields) < 3 or not fields[0].endswith("%"):
            continue
        part = PARTS.get(step_timeline.op_of(fields[2]), "everything else")
        shares[part] = shares.get(part, 0.0) + float(fields[0].rstrip("%")) / 100
    return shares


def profile_workload(args) -> None:
    """The workload's steps by group and part (step_timeline.py), each group against its step roofline."""
    from batchserve.entrypoints.llm import LLM
    from batchserve.sampling_params import SamplingParams

    requests = json.loads(args.workload.read_text())["requests"]
    llm = LLM(None, dtype=args.dtype, num_threads=1)
    llm.engine.reserve_kv_blocks(llm.engine.max_kv_blocks)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r["max_tokens"]) for r in requests]
    llm.generate([{"prompt_token_ids": requests[0]["prompt_token_ids"]}], params[0], use_tqdm=False)  # warm-up
    timeline = step_timeline.Timeline()
    timeline.watch(llm.engine)
    with tempfile.TemporaryDirectory() as folder:
        data = Path(folder) / "perf.data"
        perf = subprocess.Popen(["perf", "record", "-q", "-k", "monotonic", "-o", str(data), "-p", str(os.getpid())],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        time.sleep(0.5)  # perf attaches
        cpu = time.process_time()
        llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in requests], params, use_tqdm=False)
        cpu = time.process_time() - cpu
        perf.send_signal(signal.SIGINT)
        perf.wait()
        groups, symbols = step_timeline.breakdown(timeline, step_timeline.samples(data))
    del llm
    rates = roofline.measure(args.dtype, limits.parse_args([]).peer_ms, args.min_time, time.process_time)
    bandwidth = limits.model_scale.memory_bandwidth(1, gib=0.5, clock=time.process_time)
    print(f"{args.workload.stem}, {args.dtype}, 1 thread, load average {os.getloadavg()[0]:.1f}: "
          f"{len(timeline.steps)} steps, {cpu:.2f} CPU s (steps {sum(s.cpu_s for s in timeline.steps):.2f})")  # fmt: skip
    for group in sorted(groups):
        print_group(group, [s for s in timeline.steps if step_timeline.step_group(s) == group], groups[group],
                    rates, args.dtype, bandwidth)  # fmt: skip
    for part in sorted(symbols) if args.symbols else []:
        total = sum(symbols[part].values())
        top = sorted(symbols[part].items(), key=lambda kv: -kv[1])[: args.symbols]
        print(f"\n{part}: {total} samples; the most sampled symbols:")
        for symbol, n in top:
            print(f"  {100 * n / total:5.1f}%  {symbol[:150]}")


def print_group(group: str, steps, counts: dict[str, int], rates, dtype: str, bandwidth: float) -> None:
    """One group's CPU seconds by part, its GEMMs beside their share of the bound."""
    cpu = sum(s.cpu_s for s in steps)
    shapes = [(s.rows, s.sampled, s.kv_tokens) for s in steps]
    bound = roofline.step_roofline(rates, dtype, shapes, bandwidth)
    layers = roofline.step_roofline(rates, dtype, [(r, 0, 0) for r, _, _ in shapes], float("inf"))["matmul_s"]
    print(f"\n{group}: {len(steps)} steps, {sum(r for r, _, _ in shapes)} rows, {cpu:.2f} CPU s against a bound "
          f"of {bound['bound_s']:.2f} ({bound['bound_s'] / cpu:.2f}); matmuls {bound['matmul_s']:.2f} s "
          f"(layers {layers:.2f}, lm_head {bound['matmul_s'] - layers:.2f}), bytes {bound['memory_s']:.2f} s")  # fmt: skip
    total = sum(counts.values())
    for part, n in sorted(counts.items(), key=lambda kv: -kv[1]):
        print(f"  {part:<52} {100 * n / total:5.1f}%  {cpu * n / total:7.2f} s")


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.workload:
        if args.threads != 1:
            raise SystemExit("--workload profiles one thread (its CPU clock)")
        return profile_workload(args)
    engine = ready_engine(args)
    with tempfile.TemporaryDirectory() as folder:
        data = Path(folder) / "perf.data"
        perf = start_perf(args.perf_seconds, data)
        time.sleep(0.3 if perf else 0)  # perf attaches
        cpu, wall = [], []
        for _ in range(args.steps):
            c0, w0 = time.process_time(), time.perf_counter()
            engine.step()
            cpu.append(time.process_time() - c0)
            wall.append(time.perf_counter() - w0)
        step_cpu, step_wall = statistics.median(cpu), statistics.median(wall)
        print(f"context {args.context}, {args.threads} threads, load average {os.getloadavg()[0]:.1f}: a step "
              f"{1e3 * step_cpu:.2f} ms CPU (all threads), {1e3 * step_wall:.2f} ms wall (medians)")  # fmt: skip
        if perf is None:
            print("no perf: step times only")
        elif perf.wait() != 0 or not data.exists():
            print("perf record failed (perf_event_paranoid?): step times only")
        else:
            for part, share in sorted(perf_parts(data).items(), key=lambda kv: -kv[1]):
                print(f"  {part:<18} {100 * share:5.1f}%  {1e3 * share * step_cpu:6.2f} ms CPU")
    engine.close()


if __name__ == "__main__":
    main()
