"""Run one fixed workload through batchserve and its peers, side by side, and print one table of ratios.

    .venv/bin/python benchmarks/peer_compare.py --dtype float32 --threads 2            # the full 64 requests
    .venv/bin/python benchmarks/peer_compare.py --limit 8 --engines transformers,vllm  # a quick check

Engines (each in its own subprocess, so they share neither memory nor threads, and one runs at a time):
  batchserve     offline LLM(dtype, num_threads).generate over all requests (continuous batching)
  hf-static      transformers `generate`, static batches of 16 in workload order, left padding; each batch runs to
                 its longest request, only each request's wanted tokens count as output
  hf-stream      transformers `generate`, one request at a time, on the first --stream-requests requests (tok/s of a
                 single stream; its ratio is not comparable to the batched engines' and is shown for scale)
  vllm           vLLM's CPU build, offline vllm.LLM(...).generate with prompt_token_ids, run by the Python of
                 --vllm-python (its own venv, default bench_results/vllm-venv or $VLLM_PYTHON; see
                 docs/BENCHMARKS.md); skipped when that interpreter is missing
  llama-server   llama.cpp's server on batchserve's GGUF file as stored (its quantized tensors, f16 KV), --llama-server-slots
                 parallel slots (default 32, `llama-server -np 32`), every request sent at once to /completion as token
                 ids (benchmarks/llama_server_peer.py); the binary is --llama-server (default
                 <cache dir>/peers/llama.cpp-build/bin/llama-server, see docs/quantization.md); skipped when missing.
                 --dtype does not apply to it

Every engine: greedy (temperature 0), ignore_eos, exactly max_tokens output tokens per request, the same dtype and
thread count, one warm-up request before the clock starts (load and warm-up time are reported apart). `--clock cpu`
(with --threads 1) rates each engine by the CPU seconds of its timed part instead of the wall: its worker process and
every process under it (vLLM's engine core, llama-server), all threads, which the other load of a shared host does
not inflate. Greedy outputs
are compared token by token with hf-static's (the reference), as a check that everyone computed the same thing.
The model: batchserve runs its default (the SmolLM2-135M-Instruct Q4_1 GGUF, dequantized at load); transformers and
vLLM run the same weights dequantized once into a Hugging Face directory (benchmarks/export_hf.py, made on first use
in --hf-dir: default bench_results/smollm2-hf or $BATCHSERVE_HF_EXPORT).

Only the standard library is imported at module level: the same file is the worker in every venv.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
WORKLOAD = HERE / "workloads" / "peer64.json"
RESULTS = REPO / "bench_results"
ENGINES = ("batchserve", "hf-static", "hf-stream", "vllm", "llama-server")
REFERENCE = "hf-static"


# --- workers: each runs in its own process and writes one JSON result --------------------------------------------------


def _tree_cpu_s() -> float:
    """CPU seconds (user + system, all threads) of this process and of every live process under it, from /proc;
    this process's alone where there is no /proc."""
    own = time.process_time()
    proc = Path("/proc")
    if not (proc / "self" / "stat").is_file():
        return own
    parents, ticks = {}, {}
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # the process ended while we looked
        pid = int(stat.parent.name)
        parents[pid], ticks[pid] = int(fields[1]), int(fields[11]) + int(fields[12])
    under, frontier = set(), {os.getpid()}
    while frontier:
        frontier = {pid for pid, parent in parents.items() if parent in frontier} - under
        under |= frontier
    return own + sum(ticks[pid] for pid in under) / os.sysconf("SC_CLK_TCK")


class Timed:
    """The wall and CPU seconds (_tree_cpu_s) of a block: the timed part of a run."""

    def __enter__(self):
        self.wall0, self.cpu0 = time.perf_counter(), _tree_cpu_s()
        return self

    def __exit__(self, *exc):
        self.wall_s, self.cpu_s = time.perf_counter() - self.wall0, _tree_cpu_s() - self.cpu0

    def seconds(self) -> dict:
        return {"wall_s": self.wall_s, "cpu_s": self.cpu_s}


def _requests(args) -> list[dict]:
    requests = json.loads(Path(args.workload).read_text())["requests"]
    return requests[: args.limit] if args.limit else requests


def _torch_setup(args):
    import torch

    torch.set_num_threads(args.threads)
    return torch, {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]


def run_batchserve(args, requests: list[dict]) -> dict:
    from batchserve.entrypoints.llm import LLM
    from batchserve.sampling_params import SamplingParams

    t0 = time.perf_counter()
    options = dict(kv.split("=", 1) for kv in args.engine_option)
    llm = LLM(
        args.batchserve_model,
        dtype=args.dtype,
        num_threads=args.threads,
        **{k: _literal(v) for k, v in options.items()},
    )
    # the whole default pool at load, as before the offline LLM sized its pool to the requests: the same load and
    # the same pool as the recorded runs (and as vLLM's preallocated one); a no-op when an option sets the pool
    llm.engine.reserve_kv_blocks(llm.engine.max_kv_blocks)
    warm = requests[0]
    llm.generate([{"prompt_token_ids": warm["prompt_token_ids"]}], _bs_params(SamplingParams, 4), use_tqdm=False)
    load_s = time.perf_counter() - t0
    prompts = [{"prompt_token_ids": r["prompt_token_ids"]} for r in requests]
    params = [_bs_params(SamplingParams, r["max_tokens"]) for r in requests]
    with Timed() as timed:
        outputs = llm.generate(prompts, params, use_tqdm=False)
    return {"load_s": load_s, **timed.seconds(), "outputs": [list(o.token_ids) for o in outputs]}


def _bs_params(SamplingParams, n: int):
    return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)


def _literal(value: str):
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        return value


def _hf_model(args):
    torch, dtype = _torch_setup(args)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(args.hf_dir), dtype=dtype).eval()
    config = model.generation_config
    config.eos_token_id = None  # ignore_eos: run every request to its max_new_tokens
    config.pad_token_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    config.do_sample, config.temperature, config.top_p, config.top_k = False, None, None, None
    return torch, model, config


def _hf_generate(torch, model, config, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Greedy generate for one static batch, left padded; returns each row's generated ids."""
    width = max(len(p) for p in prompts)
    pad = config.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            generation_config=config,
            max_new_tokens=max_new_tokens,
        )
    return out[:, width:].tolist()


def run_hf_static(args, requests: list[dict]) -> dict:
    t0 = time.perf_counter()
    torch, model, config = _hf_model(args)
    _hf_generate(torch, model, config, [requests[0]["prompt_token_ids"]], 4)
    load_s = time.perf_counter() - t0
    outputs: list[list[int]] = []
    computed = 0
    with Timed() as timed:
        for start in range(0, len(requests), args.hf_batch_size):
            batch = requests[start : start + args.hf_batch_size]
            longest = max(r["max_tokens"] for r in batch)
            rows = _hf_generate(torch, model, config, [r["prompt_token_ids"] for r in batch], longest)
            outputs += [row[: r["max_tokens"]] for row, r in zip(rows, batch, strict=True)]
            computed += longest * len(batch)
    return {"load_s": load_s, **timed.seconds(), "outputs": outputs, "tokens_generated_incl_padding": computed}


def run_hf_stream(args, requests: list[dict]) -> dict:
    t0 = time.perf_counter()
    torch, model, config = _hf_model(args)
    _hf_generate(torch, model, config, [requests[0]["prompt_token_ids"]], 4)
    load_s = time.perf_counter() - t0
    outputs = []
    with Timed() as timed:
        for r in requests:
            outputs += _hf_generate(torch, model, config, [r["prompt_token_ids"]], r["max_tokens"])
    return {"load_s": load_s, **timed.seconds(), "outputs": outputs}


def run_vllm(args, requests: list[dict]) -> dict:
    t0 = time.perf_counter()
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests)
    llm = LLM(
        model=str(args.hf_dir),
        dtype=args.dtype,
        max_model_len=max(2048, longest),
        seed=0,
        **json.loads(args.vllm_options),
    )

    def params(n: int):
        return SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=n)

    llm.generate([TokensPrompt(prompt_token_ids=requests[0]["prompt_token_ids"])], params(4), use_tqdm=False)
    load_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    with Timed() as timed:
        outputs = llm.generate(prompts, [params(r["max_tokens"]) for r in requests], use_tqdm=False)
    return {"load_s": load_s, **timed.seconds(), "outputs": [list(o.outputs[0].token_ids) for o in outputs]}


def run_llama_server(args, requests: list[dict]) -> dict:
    sys.path.insert(0, str(HERE))
    import llama_server_peer

    from batchserve.models.loader import resolve_model_path

    model = resolve_model_path(args.batchserve_model)
    extra = shlex.split(args.llama_server_options)
    return llama_server_peer.run(
        args.llama_server, model, requests, args.llama_server_slots, args.threads, args.timeout, extra
    )


RUNNERS = {
    "batchserve": run_batchserve,
    "hf-static": run_hf_static,
    "hf-stream": run_hf_stream,
    "vllm": run_vllm,
    "llama-server": run_llama_server,
}


def worker_main(args) -> None:
    requests = _requests(args)
    if args.worker == "hf-stream":
        requests = requests[: args.stream_requests]
    result = RUNNERS[args.worker](args, requests)
    result.update(
        engine=args.worker,
        num_requests=len(requests),
        prompt_tokens=sum(len(r["prompt_token_ids"]) for r in requests),
        output_tokens=sum(r["max_tokens"] for r in requests),
        output_lengths_ok=all(len(o) == r["max_tokens"] for o, r in zip(result["outputs"], requests, strict=False)),
    )
    Path(args.result_file).write_text(json.dumps(result))


# --- the driver -----------------------------------------------------------------------------------------------------


def ensure_hf_export(hf_dir: Path) -> None:
    if (hf_dir / "config.json").is_file() and (hf_dir / "model.safetensors").is_file():
        return
    print(f"exporting the dequantized model to {hf_dir} (once)", flush=True)
    subprocess.run([sys.executable, str(HERE / "export_hf.py"), "--out", str(hf_dir)], check=True, cwd=HERE)


def engine_env(engine: str, threads: int) -> dict[str, str]:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH", "")]))
    if engine == "vllm":
        env.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB
        env.pop("PYTHONPATH")  # batchserve's repo is not vLLM's business
    return env


def run_engine(engine: str, args, forward: list[str]) -> dict:
    python = str(args.vllm_python) if engine == "vllm" else sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        result_file = Path(tmp) / "result.json"
        log_file = RESULTS / f"peer_{engine}.log"
        cmd = [python, str(Path(__file__).resolve()), "--worker", engine, "--result-file", str(result_file), *forward]
        load_start = os.getloadavg()[0]
        print(f"[{engine}] running (log: {log_file}; load average {load_start:.2f})", flush=True)
        t0 = time.perf_counter()
        with open(log_file, "w") as log:
            proc = subprocess.run(
                cmd,
                env=engine_env(engine, args.threads),
                stdout=log,
                stderr=subprocess.STDOUT,
                timeout=args.timeout,
                cwd=tempfile.gettempdir(),
            )
        if proc.returncode != 0 or not result_file.is_file():
            tail = log_file.read_text().splitlines()[-15:]
            print(f"[{engine}] FAILED (exit {proc.returncode}):\n  " + "\n  ".join(tail), flush=True)
            return {"engine": engine, "error": f"exit {proc.returncode}", "log_tail": tail}
        result = json.loads(result_file.read_text())
        result["process_s"] = time.perf_counter() - t0
        result["loadavg_1min_start_end"] = [load_start, os.getloadavg()[0]]
        seconds = timed_s(result, args.clock)
        rate = f"{result['output_tokens'] / seconds:.1f} output tok/s" if seconds else "no CPU time reported"
        print(
            f"[{engine}] {rate} ({args.clock} clock), wall {result['wall_s']:.1f} s"
            f"{_cpu_note(result)}, load+warm-up {result['load_s']:.1f} s",
            flush=True,
        )
        return result


def timed_s(result: dict, clock: str) -> float | None:
    """The seconds an engine's rate is read from: its timed part's wall or CPU seconds (None: not reported)."""
    return result.get("cpu_s") if clock == "cpu" else result.get("wall_s")


def _cpu_note(result: dict) -> str:
    return f", CPU {result['cpu_s']:.1f} s" if result.get("cpu_s") is not None else ""


def agreement(result: dict, reference: dict | None) -> str:
    """Requests whose greedy output equals the reference's, and the mean share of leading tokens in common."""
    if "outputs" not in result or reference is None or "outputs" not in reference:
        return "-"
    pairs = list(zip(result["outputs"], reference["outputs"], strict=False))
    same = sum(a == b for a, b in pairs)
    prefix = [
        next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))) / max(len(b), 1)
        for a, b in pairs
    ]
    return f"{same}/{len(pairs)} same, {100 * sum(prefix) / len(prefix):.0f}% prefix"


def table(results: list[dict], clock: str) -> list[str]:
    """One line per engine, its rates by `clock`'s seconds (wall, or the CPU seconds of its processes)."""
    base = next((r for r in results if r["engine"] == "batchserve" and timed_s(r, clock)), None)
    reference = next((r for r in results if r["engine"] == REFERENCE and "outputs" in r), None)
    head = (
        f"{'engine':<12} {'reqs':>4} {'out tok/s':>10} {'total tok/s':>11} {clock + ' s':>8} {'start s':>7} "
        f"{'out x bs':>8} {'total x bs':>10} {'loadavg':>10}  greedy vs {REFERENCE}"
    )
    lines = [head, "-" * len(head)]
    for r in results:
        seconds = timed_s(r, clock)
        if not seconds:
            lines.append(f"{r['engine']:<12} failed: {r.get('error', f'no {clock} seconds reported')}")
            continue
        base_s = timed_s(base, clock) if base else None
        out_tps = r["output_tokens"] / seconds
        total_tps = (r["prompt_tokens"] + r["output_tokens"]) / seconds
        r.update(output_tok_s=out_tps, total_tok_s=total_tps, clock=clock)
        if base:
            r["ratio_output_vs_batchserve"] = out_tps / (base["output_tokens"] / base_s)
            r["ratio_total_vs_batchserve"] = total_tps / ((base["prompt_tokens"] + base["output_tokens"]) / base_s)
        ratio = (
            f"{r['ratio_output_vs_batchserve']:>8.2f} {r['ratio_total_vs_batchserve']:>10.2f}"
            if base
            else f"{'-':>8} {'-':>10}"
        )
        lines.append(
            f"{r['engine']:<12} {r['num_requests']:>4} {out_tps:>10.1f} {total_tps:>11.1f} {seconds:>8.1f} "
            f"{r['load_s']:>7.1f} {ratio} {'{:.1f}->{:.1f}'.format(*r['loadavg_1min_start_end']):>10}  "
            f"{agreement(r, reference)}"
        )
    return lines


def machine(args) -> dict:
    from batchserve.bench.machine import machine_info  # the driver runs in batchserve's venv

    return {"python": platform.python_version(), **machine_info(args.threads, args.dtype)}


def driver_main(args, forward: list[str]) -> None:
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        raise SystemExit(f"unknown engine(s) {sorted(unknown)}; choose from {ENGINES}")
    if "vllm" in engines and not args.vllm_python.exists():
        print(f"[vllm] skipped: {args.vllm_python} not found (see --vllm-python and docs/BENCHMARKS.md)")
        engines.remove("vllm")
    if "llama-server" in engines and not args.llama_server.is_file():
        print(f"[llama-server] skipped: {args.llama_server} not found (see --llama-server and docs/quantization.md)")
        engines.remove("llama-server")
    RESULTS.mkdir(exist_ok=True)
    if set(engines) & {"hf-static", "hf-stream", "vllm"}:
        ensure_hf_export(args.hf_dir)
    # The reference runs first so every later line can be compared with it.
    engines.sort(key=lambda e: (e != REFERENCE, ENGINES.index(e)))
    from batchserve.bench.machine import describe

    load_before = os.getloadavg()
    print(f"machine: {describe(machine(args))}")
    print(
        f"load average before: {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f} "
        f"({os.cpu_count()} CPUs); dtype {args.dtype}, threads {args.threads}, clock {args.clock}",
        flush=True,
    )
    results = [run_engine(e, args, forward) for e in engines]
    load_after = os.getloadavg()
    order = {e: i for i, e in enumerate(ENGINES)}
    results.sort(key=lambda r: order[r["engine"]])
    lines = table(results, args.clock)
    print()
    print("\n".join(lines))
    print(
        f"\nload average before {load_before[0]:.2f} / after {load_after[0]:.2f} (1-min); "
        f"ratios are engine / batchserve, by the {args.clock} clock; start s = load + warm-up (not timed); loadavg = 1-min load when the "
        f"engine's process started -> ended; hf-stream runs only {args.stream_requests} requests one at a time"
    )
    stamp = time.strftime("%Y%m%d-%H%M%S")
    out = RESULTS / f"peer_compare-{args.dtype}-{stamp}.json"
    record = {
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": machine(args),
        "loadavg_before": load_before,
        "loadavg_after": load_after,
        "table": lines,
        "results": [{k: v for k, v in r.items() if k != "outputs"} for r in results],
        "outputs": {r["engine"]: r["outputs"] for r in results if "outputs" in r},
    }
    out.write_text(json.dumps(record, indent=1))
    print(f"saved {out}")


def parse_args(argv: list[str] | None = None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads for every engine (default 2)")
    ap.add_argument(
        "--clock",
        choices=("wall", "cpu"),
        default="wall",
        help="cpu: rate each engine by the CPU seconds of its processes in the timed part, which a loaded host does "
        "not inflate (with --threads 1, or more under OMP_WAIT_POLICY=passive: machine.clock_refusal)",
    )
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma-separated subset of {','.join(ENGINES)}")
    ap.add_argument("--limit", type=int, default=0, help="only the first N requests of the workload (0: all)")
    ap.add_argument("--workload", type=Path, default=WORKLOAD)
    ap.add_argument(
        "--hf-dir",
        type=Path,
        default=None,
        help="dequantized HF export for transformers and vLLM (default: $BATCHSERVE_HF_EXPORT, else "
        "bench_results/smollm2-hf; made on first use)",
    )
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--stream-requests", type=int, default=4, help="requests for hf-stream (one at a time)")
    ap.add_argument("--batchserve-model", default=None, help="model for batchserve (default: its default GGUF)")
    ap.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="extra batchserve engine option (repeatable), e.g. max_batch_size=64",
    )
    ap.add_argument("--vllm-options", default="{}", help="JSON of extra vllm.LLM(...) keyword arguments")
    ap.add_argument(
        "--vllm-python",
        type=Path,
        default=None,
        help="Python of the venv holding vLLM's CPU build (default: $VLLM_PYTHON, else bench_results/vllm-venv/bin/python)",
    )
    ap.add_argument("--llama-server", type=Path, default=None, help="llama.cpp's llama-server binary")
    ap.add_argument("--llama-server-slots", type=int, default=32, help="llama-server -np (parallel slots)")
    ap.add_argument("--llama-server-options", default="", help="more llama-server arguments, e.g. '-kvu -fa on'")
    ap.add_argument("--timeout", type=float, default=3600, help="seconds allowed per engine")
    ap.add_argument("--worker", choices=ENGINES, help=argparse.SUPPRESS)
    ap.add_argument("--result-file", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main() -> None:
    args = parse_args()
    if args.worker:
        worker_main(args)
        return
    from batchserve import env  # the driver runs in batchserve's venv (a worker may not: vLLM's)
    from batchserve.bench.machine import clock_refusal

    if refusal := clock_refusal(args.clock, args.threads, os.environ.get("OMP_WAIT_POLICY", "")):
        raise SystemExit(refusal)
    forward = [a for a in sys.argv[1:] if a not in ("--worker",)]
    args.workload, args.hf_dir = args.workload.resolve(), (args.hf_dir or env.hf_export_dir()).resolve()
    args.vllm_python = (args.vllm_python or env.vllm_python()).absolute()  # not resolve(): a venv's python is a link
    args.llama_server = (
        args.llama_server or env.cache_dir() / "peers" / "llama.cpp-build" / "bin" / "llama-server"
    ).absolute()
    forward += ["--workload", str(args.workload), "--hf-dir", str(args.hf_dir)]
    forward += ["--llama-server", str(args.llama_server)]
    driver_main(args, forward)


if __name__ == "__main__":
    main()
