"""Tensor parallelism on one host: 2 ranks x 1 thread against 1 process x 2 threads, decode throughput at batch 32.

    .venv/bin/python benchmarks/tensor_parallel.py                       # Llama-3.1-8B layer shapes, 2 of 32 layers
    .venv/bin/python benchmarks/tensor_parallel.py --layers 32           # the whole 8B (16 GB of bf16 written first)
    .venv/bin/python benchmarks/tensor_parallel.py --preset tiny-llama   # seconds: checks the script works
    .venv/bin/python benchmarks/tensor_parallel.py --pipeline --layers 4 --vocab 8192 --rounds 2
                                                          # 2 pipeline stages: micro-batches on / off, alternating
    .venv/bin/python benchmarks/tensor_parallel.py --layers 32 --rank-memory-cap-gib 10 --configs "1 process x 2 threads" "2 ranks x 1 thread"
                                                          # the whole 8B, each process capped at 10 GiB

Writes a random-weight checkpoint of the preset's shapes (benchmarks/model_scale.py; --layers keeps the first N
layers: each layer's shapes, and so its GEMMs and its two all-reduces, are the real model's; the embedding and output
matrix are whole), then runs each configuration in a fresh process (2 ranks: all-reducing through shared memory, and
through gloo's loopback TCP): B requests of --prompt-len random tokens, all
prefilled in one step, then --output-len decode steps, timed. Reports decode tok/s (B tokens a decode step), the step
time, the time rank 0 spent in collectives during the decode steps (all-reduces and the logits' all-gather, waits for
the other rank included) as a share of the step, and the peak RSS of each rank's process. Prints a table and a JSON
line. Run it on a quiet host: the two configurations share its cores.

--pipeline compares pipeline stages instead: 2 stages x 1 thread with micro-batches off (pipeline_micro_batches 1)
and with the decode rows in 2 micro-batches; "collectives" is then rank 0's time in the hand-over to the next stage
and in the step output's broadcast (the wait for the last stage included). --vocab shrinks the vocabulary, so that
the layers, not the output matrix (all on the last stage), weigh in a step. --rounds N runs the configurations N
times, alternating, and reports each one's best round (a loaded host slows some rounds).

--rank-memory-cap-gib G runs each configuration's processes in a memory cgroup of G GiB a rank (Linux cgroup v1 or
v2, writable by this user: as a container's memory limit, it counts resident memory, page cache included, which it
reclaims before it kills), and reports each rank's peak RSS. A configuration that cannot run under the cap is reported
with how it ended. The engine runs with max_num_tokens = batch x prompt length, under bf16 AMX's row limit, so each
projection is laid out once (LinearPolicy.max_rows).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from model_scale import PRESETS, write_checkpoint

# name -> (tensor_parallel_size, threads a rank, all-reduce through shared memory, pipeline stages, micro-batches)
CONFIGS = {
    "1 process x 2 threads": (1, 2, True, 1, 1),
    "2 ranks x 1 thread": (2, 1, True, 1, 1),
    "2 ranks x 1 thread, gloo": (2, 1, False, 1, 1),
}
PIPELINE_CONFIGS = {
    "2 stages x 1 thread, whole": (1, 1, True, 2, 1),
    "2 stages x 1 thread, 2 micro": (1, 1, True, 2, 2),
}


def _peak_rss_gib(pid: int | str = "self") -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024**2
    return 0.0


def measure(folder: Path, config: tuple, batch: int, prompt_len: int, output_len: int, dtype: str) -> dict:
    """In this fresh process: the engine at tensor_parallel_size `tp`, `threads` threads a rank, `pp` pipeline stages
    of `micro` micro-batches; one prefill step of every request, then the decode steps timed."""
    from batchserve import LLM, SamplingParams

    tp, threads, _, pp, micro = config
    blocks = batch * (-(-(prompt_len + output_len) // 16) + 1)
    start = time.perf_counter()
    llm = LLM(model=str(folder), dtype=dtype, num_threads=threads, tensor_parallel_size=tp, max_batch_size=batch,
              num_kv_blocks=blocks, enable_prefix_caching=False, max_num_tokens=batch * prompt_len,
              pipeline_parallel_size=pp, pipeline_micro_batches=micro)  # fmt: skip
    load_s = time.perf_counter() - start
    engine = llm.engine
    generator = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=output_len + 1, temperature=0.0, ignore_eos=True)
    for _ in range(batch):
        prompt = torch.randint(3, engine.model_config.vocab_size, (prompt_len,), generator=generator).tolist()
        engine.add_prompt(None, {"prompt_token_ids": prompt}, params)
    engine.step()  # every prompt, and each request's first token
    runner = engine.runner
    stats = runner.tp.stats if tp > 1 else runner.stage.stats if pp > 1 else None
    if stats is not None:
        stats.take()
    start = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    decode_s = time.perf_counter() - start
    collective_s = stats.take().seconds if stats is not None else 0.0
    ranks = [_peak_rss_gib()] + [_peak_rss_gib(w.pid) for w in getattr(runner, "workers", [])]
    return {"load_s": load_s, "decode_tok_s": batch * steps / decode_s, "step_ms": 1e3 * decode_s / steps,
            "collective_share": collective_s / decode_s, "peak_rss_gib_per_rank": ranks}  # fmt: skip


def _allreduce_rank(rank: int, port: int, shape: tuple[int, int], calls: int, buffers, results) -> None:
    """One of two ranks: `calls` all-reduces of a bf16 `shape` through gloo, then through shared memory."""
    import datetime

    import torch.distributed as dist

    from batchserve.host.shared_allreduce import SharedAllReduce

    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timeout, wait_for_workers=False)
    group = dist.ProcessGroupGloo(store, rank, 2, timeout)
    shared = SharedAllReduce(buffers, rank, lambda: True)
    x = torch.ones(shape, dtype=torch.bfloat16)
    for name, reduce in (("gloo", lambda t: group.allreduce([t]).wait()), ("shared memory", shared)):
        for _ in range(5):
            reduce(x)
        group.barrier().wait()
        start = time.perf_counter()
        for _ in range(calls):
            reduce(x)
        if rank == 0:
            results[name] = 1e6 * (time.perf_counter() - start) / calls


def allreduce_alone(hidden: int, batch: int, calls: int = 200) -> dict:
    """Microseconds per all-reduce of a decode step's [batch, hidden] bf16 activation between two processes of one
    thread each: gloo's loopback TCP against shared memory."""
    import socket

    import torch.multiprocessing as mp

    from batchserve.host.shared_allreduce import SharedBuffers

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    results = mp.get_context("spawn").Manager().dict()
    buffers = SharedBuffers.allocate(2, batch * hidden)
    # by its module's name: a spawned child cannot find a function of the __main__ script
    target = importlib.import_module(Path(__file__).stem)._allreduce_rank
    mp.spawn(target, args=(port, (batch, hidden), calls, buffers, results), nprocs=2)
    return dict(results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="llama-3.1-8b", choices=[p for p in PRESETS if "moe" not in p])
    parser.add_argument("--layers", type=int, default=2, help="keep the first N layers (default 2)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--output-len", type=int, default=8)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--dir", type=Path, default=None, help="checkpoint folder (default: a temporary one)")
    parser.add_argument("--pipeline", action="store_true", help="2 pipeline stages, micro-batches on and off")
    parser.add_argument("--vocab", type=int, default=None, help="vocabulary size (default: the preset's)")
    parser.add_argument("--rounds", type=int, default=1, help="run the configurations this many times, alternating")
    parser.add_argument("--rank-memory-cap-gib", type=float, default=None, help="cap each process's private memory")
    parser.add_argument("--configs", nargs="+", default=None, help="run only these configurations (by name)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        result = measure(args.dir, tuple(json.loads(args.child)), args.batch, args.prompt_len, args.output_len,
                         args.dtype)  # fmt: skip
        print("RESULT " + json.dumps(result), flush=True)
        return
    shapes = dataclasses.replace(PRESETS[args.preset], num_layers=args.layers or PRESETS[args.preset].num_layers)
    if args.vocab:
        shapes = dataclasses.replace(shapes, vocab_size=args.vocab)
    folder = args.dir or Path(tempfile.mkdtemp(prefix="tp-bench-"))
    try:
        if not (folder / "config.json").is_file():
            gib = write_checkpoint(shapes, folder, getattr(torch, args.dtype)) / 1024**3
            print(f"wrote {gib:.2f} GiB of {args.dtype} weights: {shapes.name}, {shapes.num_layers} layers", flush=True)
        results = {} if args.pipeline else {"all-reduce alone, us": allreduce_alone(shapes.hidden_size, args.batch)}
        print(json.dumps(results), flush=True)
        for _ in range(args.rounds):
            for name, config in _configs(args).items():
                result = _run_child(args, folder, config)
                print(name, json.dumps(result), flush=True)
                best = results.get(name)
                if best is None or result.get("decode_tok_s", 0) > best.get("decode_tok_s", 0):
                    results[name] = result
    finally:
        if args.dir is None:
            shutil.rmtree(folder, ignore_errors=True)
    _report(args, shapes, results)


def _configs(args) -> dict[str, tuple]:
    every = PIPELINE_CONFIGS if args.pipeline else CONFIGS
    unknown = set(args.configs or ()) - set(every)
    if unknown:
        raise SystemExit(f"unknown configurations {sorted(unknown)}; there are {sorted(every)}")
    return {name: config for name, config in every.items() if not args.configs or name in args.configs}


def memory_cgroup(name: str, limit_bytes: int) -> Path:
    """A new memory cgroup of `limit_bytes` (v2's memory.max, else v1's memory.limit_in_bytes); a process joins it by
    writing its pid to its cgroup.procs. Refused where this user cannot make one."""
    v2 = Path("/sys/fs/cgroup")
    base, limit_file = (v2, "memory.max") if (v2 / "cgroup.controllers").is_file() else (v2 / "memory", None)
    limit_file = limit_file or "memory.limit_in_bytes"
    group = base / name
    try:
        group.mkdir()
        (group / limit_file).write_text(str(limit_bytes))
    except OSError as error:
        raise SystemExit(
            f"--rank-memory-cap-gib needs a memory cgroup this user can make under {base}: {error}"
        ) from None
    return group


def _remove_cgroup(group: Path) -> None:
    """The cgroup removed once its processes (ranks the child left behind) are gone: killed after 10 s."""
    deadline = time.monotonic() + 10
    while pids := (group / "cgroup.procs").read_text().split():
        if time.monotonic() > deadline:
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.2)
    group.rmdir()


def _run_child(args, folder: Path, config: tuple) -> dict:
    command = [sys.executable, __file__, "--child", json.dumps(config), "--dir", str(folder), "--batch",
               str(args.batch), "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
               "--dtype", args.dtype]  # fmt: skip
    env = {**os.environ, "TQDM_DISABLE": "1", "BATCHSERVE_SHARED_ALLREDUCE": "1" if config[2] else "0"}
    group = None
    if args.rank_memory_cap_gib:
        group = memory_cgroup(
            f"tp-bench-{os.getpid()}", int(args.rank_memory_cap_gib * 1024**3) * config[0] * config[3]
        )
    try:
        join = None if group is None else lambda: (group / "cgroup.procs").write_text(str(os.getpid()))
        out = subprocess.run(command, capture_output=True, text=True, env=env, preexec_fn=join)
    finally:
        if group is not None:
            _remove_cgroup(group)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not lines:
        if args.rank_memory_cap_gib:  # not running under the cap is a result here
            how = "killed" if out.returncode < 0 else "error"
            return {"error": f"{how} (exit {out.returncode}): " + (out.stderr.strip().splitlines() or [""])[-1][-300:]}
        raise SystemExit(f"{config}: exit {out.returncode}\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def _report(args, shapes, results: dict) -> None:
    ran = [r for name, r in results.items() if name in _configs(args) and "error" not in r]
    base = ran[0]["decode_tok_s"] if ran else 1.0
    print(f"\n{shapes.name}, {shapes.num_layers} layers, vocabulary {shapes.vocab_size}, {args.dtype}, batch "
          f"{args.batch}, {args.output_len} decode steps, best of {args.rounds}")  # fmt: skip
    columns = f"{'decode tok/s':>12} {'step ms':>8} {'vs first run':>12} {'collectives':>11}"
    print(f"{'configuration':29} {columns}  peak RSS/rank")
    for name, r in results.items():
        if name not in _configs(args):
            continue
        if "error" in r:
            print(f"{name:29} did not run under the cap: {r['error']}")
            continue
        rss = ", ".join(f"{g:.2f}" for g in r["peak_rss_gib_per_rank"])
        print(f"{name:29} {r['decode_tok_s']:12.1f} {r['step_ms']:8.1f} {r['decode_tok_s'] / base:11.2f}x "
              f"{100 * r['collective_share']:10.1f}%  {rss} GiB")  # fmt: skip
    alone = results.get("all-reduce alone, us", {})
    if alone:
        print(f"one all-reduce of [{args.batch}, {shapes.hidden_size}] bf16 between 2 processes: "
              + ", ".join(f"{name} {us:.0f} us" for name, us in alone.items()))  # fmt: skip
    print(json.dumps({"shapes": shapes.name, "layers": shapes.num_layers, "batch": args.batch,
                      "rank_memory_cap_gib": args.rank_memory_cap_gib, "results": results}))  # fmt: skip


if __name__ == "__main__":
    main()
