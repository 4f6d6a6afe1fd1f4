"""The SLO mix's trace through vLLM's CPU build: the worker (run by vLLM's own venv) and the driver that starts it.

benchmarks/slo_mix.py --vllm hands this module the trace (each request's arrival offset, prompt token ids and
max_tokens); the worker feeds vLLM's engine the requests as they fall due, steps it, and records when each request's
first and last tokens came back, on its own clock, as bench's offline driver does for batchserve (a request's
arrival is its offset after the start, even when a step in progress delays its add). slo_mix.py turns those times
into TTFT / TPOT and goodput with the same targets as the other runs.

vLLM runs in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0) on --threads OpenMP threads, so that, like batchserve's
offline engine, scheduling, the model and detokenizing share the threads given; greedy, ignore_eos, exactly
max_tokens tokens; one untimed warm-up of a short and a long request first.

Only the standard library is imported at module level: the same file is the worker in vLLM's venv.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

# vLLM's settings for the mix (EngineArgs names): chunked prefill within the mix's token budget and batch cap, long
# prompts chunked to the SLO policies' threshold. vLLM 0.32 has no max_num_partial_prefills /
# max_long_partial_prefills any more (its V1 scheduler dropped them); `--vllm-options` (JSON) overrides or adds
# (scheduling_policy "priority" serves the short requests first).
BEST = {
    "enable_chunked_prefill": True,
    "max_num_batched_tokens": 8192,
    "max_num_seqs": 32,
    "long_prefill_token_threshold": 128,
}


# --- the worker: vLLM's venv --------------------------------------------------------------------------------------


def build_engine(args):
    from vllm import EngineArgs, LLMEngine

    options = json.loads(args.options)
    return LLMEngine.from_engine_args(EngineArgs(model=args.hf_dir, dtype=args.dtype, seed=0, **options))


def sampling(n: int):
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)


def add(engine, request_id: str, request: dict, priority: int) -> None:
    prompt = {"prompt_token_ids": request["prompt_token_ids"]}  # a vllm.inputs.TokensPrompt (a TypedDict)
    engine.add_request(request_id, prompt, sampling(request["max_tokens"]), priority=priority)


def warm_up(engine, trace: list[dict]) -> float:
    """A short and a long request shaped like the trace's, 8 tokens each, to completion: the first forward of each
    shape (and whatever the build compiles on first use) is not timed. Their prompts are the trace's reversed, so the
    prefix cache holds nothing a timed request could hit."""
    started = time.monotonic()
    picks = {r["category"]: r for r in trace}
    for i, r in enumerate(picks.values()):
        add(engine, f"warmup-{i}", dict(r, prompt_token_ids=r["prompt_token_ids"][::-1], max_tokens=8), 0)
    while engine.has_unfinished_requests():
        engine.step()
    return time.monotonic() - started


class CpuClock:
    """This thread's CPU time plus the time skipped while no request is due (slo_mix.py's --cpu-clock): vLLM's
    scheduling decides nothing by the clock, so the run's times on it are those of a quiet host, provided the model
    runs on this thread (one OpenMP thread; the worker reports the process's CPU time beside the thread's)."""

    def __init__(self) -> None:
        self.skipped = 0.0

    def __call__(self) -> float:
        return time.thread_time() + self.skipped

    def sleep(self, seconds: float) -> None:
        self.skipped += max(0.0, seconds)


def drive(engine, trace: list[dict], priorities: dict[str, int], clock=time.monotonic, sleep=time.sleep) -> list[dict]:
    """Add each request when its offset has passed, step while any is unfinished, stamp first and last tokens."""
    pending = sorted(trace, key=lambda r: r["arrival_s"])
    live: dict[str, dict] = {}
    done: list[dict] = []
    t0 = clock()
    while pending or live:
        now = clock() - t0
        while pending and pending[0]["arrival_s"] <= now:
            r = pending.pop(0)
            add(engine, r["request_id"], r, priorities.get(r["category"], 0))
            live[r["request_id"]] = {"request_id": r["request_id"], "arrival_s": r["arrival_s"], "output_len": 0,
                                     "first_token_s": None, "finish_s": None}  # fmt: skip
        if not live:
            sleep(max(0.0, pending[0]["arrival_s"] - (clock() - t0)))
            continue
        outputs = engine.step()
        end = clock() - t0
        for out in outputs:
            rec = live.get(out.request_id)
            if rec is None:
                continue
            rec["output_len"] = len(out.outputs[0].token_ids) if out.outputs else 0
            if rec["first_token_s"] is None and rec["output_len"]:
                rec["first_token_s"] = end
            if out.finished:
                rec["finish_s"] = end
                done.append(live.pop(out.request_id))
    return done


def worker_main(args) -> None:
    trace = json.loads(Path(args.trace).read_text())
    t = time.monotonic()
    engine = build_engine(args)
    load_s = time.monotonic() - t
    warm_s = warm_up(engine, trace)
    import vllm

    load, cpu = os.getloadavg()[0], (time.thread_time(), time.process_time())
    clock = CpuClock() if args.cpu_clock else time.monotonic
    timing = {"clock": clock, "sleep": clock.sleep} if args.cpu_clock else {}
    results = drive(engine, trace, json.loads(args.priorities), **timing)
    cpu_s = {"thread": time.thread_time() - cpu[0], "process": time.process_time() - cpu[1]}
    Path(args.result).write_text(json.dumps({"version": vllm.__version__, "load_s": load_s, "warmup_s": warm_s,
                                             "loadavg": [load, os.getloadavg()[0]], "cpu_s": cpu_s,
                                             "results": results}))  # fmt: skip


# --- the driver: batchserve's venv ---------------------------------------------------------------------------------


def run(trace: list[dict], hf_dir: Path, python: Path, options: dict, priorities: dict[str, int], threads: int,
        log_file: Path, timeout: float, cpu_clock: bool = False) -> dict:  # fmt: skip
    """Run the worker on `trace` in vLLM's interpreter `python`; returns its result (per-request times)."""
    sys.path.insert(0, str(HERE))
    from peer_compare import engine_env, ensure_hf_export

    if not python.exists():
        raise SystemExit(f"no vLLM interpreter at {python}: install its CPU build (docs/BENCHMARKS.md) or pass "
                         "--vllm-python")  # fmt: skip
    ensure_hf_export(hf_dir)
    env = dict(engine_env("vllm", threads), VLLM_ENABLE_V1_MULTIPROCESSING="0")
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in trace)
    options = {"max_model_len": max(2048, longest)} | options
    with tempfile.TemporaryDirectory() as tmp:
        trace_file, result_file = Path(tmp) / "trace.json", Path(tmp) / "result.json"
        trace_file.write_text(json.dumps(trace))
        cmd = [str(python), str(Path(__file__).resolve()), "--worker", "--trace", str(trace_file), "--result",
               str(result_file), "--hf-dir", str(hf_dir), "--options", json.dumps(options), "--priorities",
               json.dumps(priorities), *(["--cpu-clock"] if cpu_clock else [])]  # fmt: skip
        log_file.parent.mkdir(parents=True, exist_ok=True)
        with open(log_file, "w") as log:
            proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout,
                                  cwd=tempfile.gettempdir())  # fmt: skip
        if proc.returncode != 0 or not result_file.is_file():
            tail = "\n  ".join(log_file.read_text().splitlines()[-15:])
            raise SystemExit(f"vLLM's run failed (exit {proc.returncode}; log {log_file}):\n  {tail}")
        return json.loads(result_file.read_text()) | {"options": options}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true", required=True, help="run as the worker (slo_mix.py starts it)")
    p.add_argument("--trace", required=True)
    p.add_argument("--result", required=True)
    p.add_argument("--hf-dir", required=True)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--options", default=json.dumps(BEST), help="JSON of vllm EngineArgs keywords")
    p.add_argument("--cpu-clock", action="store_true", help="time on this thread's CPU time (CpuClock)")
    p.add_argument("--priorities", default="{}", help="JSON {category: priority} (scheduling_policy 'priority')")
    return p.parse_args(argv)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    worker_main(parse_args())
