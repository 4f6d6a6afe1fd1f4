"""Where one decode step's time goes: the default model decodes after a --context-token prompt while `perf record`
samples this process, and the samples are summed into the step's parts (the weights' GEMMs, the decode attention,
everything else), each as a share of the step and in ms.

    PYTHONPATH=. .venv/bin/python benchmarks/step_profile.py --context 8000 --threads 1

The step is timed by this process's CPU clock (with --threads 1) and the wall clock. Needs `perf` (Linux) with
permission to sample its own process; without it the step times alone are printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import limits  # noqa: E402

# symbol substrings -> part of the step (first match wins); the rest is "everything else"
PARTS = (("gemm", "weights' GEMMs"), ("decode_items", "decode attention"), ("decode_attention", "decode attention"))


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--context", type=int, default=8000)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=120, help="decode steps timed (context + steps <= the model's)")
    ap.add_argument("--perf-seconds", type=float, default=2.5, help="how long perf samples (0: no perf)")
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
        part = next((name for key, name in PARTS if key in fields[2]), "everything else")
        shares[part] = shares.get(part, 0.0) + float(fields[0].rstrip("%")) / 100
    return shares


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
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
