"""The GPU check as one prepared script (under 8 minutes on an H200): everything its "must hold" list asks
for, written as one JSON and printed as a table. It runs on the CPU too, as a smoke test of the script itself.

    python3 benchmarks/gpu_check.py --out "$OUT"                                   # on a lent GPU (cuda, defaults)
    .venv/bin/python benchmarks/gpu_check.py --device cpu --smoke                  # the smoke test here (tiny shapes)

Sections, most important first (each on its own: one that fails records its error and the rest go on; none starts
after --budget-s; the JSON is rewritten after each, so a run cut short keeps what it measured):
- environment: GPU, driver, torch, Triton;
- kernels: the Triton paged-attention kernels against the torch gather-and-pad path on random pools (GPU only);
- fused_norm: RMSNorm + residual, torch's code against the fused Triton kernel (layers/gpu/fused_norm.py), time a call
  (GPU only; the kernel is not wired into the layers until this says it pays);
- parity: greedy float32 tokens of batchserve (all requests in one batch, TF32 off) against transformers' `generate`
  (one request at a time) on the same device;
- decode_after, decode_before: SmolLM2-135M shapes, --dtype, step time and tok/s at batch 1/64/256 with --context
  tokens of context, "after" (Triton kernels, CUDA graphs) and "before" (torch attention, eager:
  BATCHSERVE_GPU_ATTENTION=torch, enforce_eager), with kernel launches and host syncs per decode step (torch.profiler);
- big: Llama-3.1-8B shapes with random weights built on the device, step time at batch 1 and 64 against the
  weight-streaming bound (weight bytes / the device-to-device bandwidth measured here: bytes read + written by a
  large copy per second), and its TTFT;
- ttft: the time to the first token of a --ttft-len prompt (SmolLM2 shapes).

Weights: SmolLM2-135M-Instruct's exact shapes (tiny ones with --smoke) with seeded random weights saved as an HF
checkpoint in a temporary folder (the device machine cannot download), drawn at a large scale so greedy decoding has
decisive logits.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import json
import os
import random
import statistics
import subprocess
import tempfile
import time
import traceback
from pathlib import Path

import torch
from roofline import HEADS, HIDDEN, INTERMEDIATE, KV_HEADS, LAYERS, VOCAB  # SmolLM2-135M's shapes

SMOLLM2_135M = dict(
    vocab_size=VOCAB,
    hidden_size=HIDDEN,
    intermediate_size=INTERMEDIATE,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
    max_position_embeddings=8192,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)
SMOKE_SHAPES = {**SMOLLM2_135M, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
# batchserve ModelConfig fields of the big model; "tiny" keeps the smoke test cheap
BIG_SHAPES = {
    "llama-3.1-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                         num_kv_heads=8, head_dim=128, max_position_embeddings=131072, rope_theta=500000.0),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=32, max_position_embeddings=4096),
}  # fmt: skip
# what counts as a launch and as a host sync in a profile (CUDA runtime and driver API calls, aten ops that sync)
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "aten::_local_scalar_dense")
MODES = {"before": ("torch", True), "after": ("triton", False)}  # BATCHSERVE_GPU_ATTENTION, enforce_eager


# --- models and engines --------------------------------------------------------------------------------------------
def word_tokenizer(vocab_size: int):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="w2", pad_token="w2")


def random_checkpoint(directory: Path, shapes: dict = SMOLLM2_135M, seed: int = 0) -> Path:
    """An HF checkpoint of these shapes with random weights, and a word-level tokenizer over its vocabulary."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(**shapes, initializer_range=0.08)).float().eval().save_pretrained(directory)
    word_tokenizer(shapes["vocab_size"]).save_pretrained(directory)
    return directory


def engine_for(model: str, device: str, dtype: str, **options):
    from batchserve.engine.llm_engine import LLMEngine

    return LLMEngine.from_options(model=model, device=device, dtype=dtype, **options)


def big_engine(shapes: dict, device: str, dtype: str, **options):
    """An engine over batchserve's Llama built on the device with random weights (no checkpoint: 16 GB of them)."""
    from batchserve.config import EngineConfig, ModelConfig
    from batchserve.engine.llm_engine import LLMEngine
    from batchserve.models.llama import LlamaForCausalLM
    from batchserve.worker.model_runner import ModelRunner

    model_config = ModelConfig(**shapes, eos_token_ids=[2])
    torch_dtype = getattr(torch, dtype)
    with torch.device("meta"):
        model = LlamaForCausalLM(model_config, dtype=torch_dtype)
    model.to_empty(device=device)
    model.rotary.reset(torch.device(device))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.fill_(1.0)
            else:
                param.normal_(0.0, 0.02)
    model.eval().requires_grad_(False)
    if device == "cpu":
        model.use_cpu_linear_layouts()
    config = EngineConfig.from_options(device=device, dtype=dtype, **options)
    runner = ModelRunner(config, model_config, model, torch.device(device), torch_dtype)
    return LLMEngine(config, runner=runner, tokenizer=word_tokenizer(shapes["vocab_size"]), model_config=model_config)


def release(engine) -> None:
    """Free an engine's device memory before the next one (the runner and its graphs hold one another)."""
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def mode(name: str):
    """The "before" / "after" configuration: BATCHSERVE_GPU_ATTENTION for the block, enforce_eager to pass on."""
    attention, eager = MODES[name]
    old = os.environ.get("BATCHSERVE_GPU_ATTENTION")
    os.environ["BATCHSERVE_GPU_ATTENTION"] = attention
    try:
        yield {"enforce_eager": eager}
    finally:
        os.environ.pop("BATCHSERVE_GPU_ATTENTION") if old is None else os.environ.update(BATCHSERVE_GPU_ATTENTION=old)


def greedy(max_tokens: int):
    from batchserve.sampling_params import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def prompts(count: int, rng: random.Random, low: int, high: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(low, high + 1))] for _ in range(count)]


def submit(engine, request_id: str, prompt: list[int], max_tokens: int) -> None:
    engine.add_request(engine.requests.from_prompt(request_id, prompt, greedy(max_tokens)))


def save(result: dict, out: Path, name: str) -> None:
    """One JSON result in `out`, named `name` and the time (gpu_profile.py saves through this too)."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"saved {path}")


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# --- sections ------------------------------------------------------------------------------------------------------
def environment(device: str) -> dict:
    info = {"device": device, "torch": torch.__version__}
    with contextlib.suppress(ImportError):
        import triton

        info["triton"] = triton.__version__
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            query = ["nvidia-smi", "--query-gpu=driver_version,memory.total", "--format=csv,noheader"]
            info["driver"] = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
    return info


def kernel_check(device: str) -> dict:
    """The Triton kernels against the torch path on random pools with shuffled block tables (a mixed step: decodes
    and chunks after cached context), SmolLM2's and Llama-3.1-8B's head shapes, each pool dtype."""
    from batchserve.core.outputs import NewRequestData, SchedulerOutput
    from batchserve.layers import attention
    from batchserve.layers.gpu import paged_attention as gpu
    from batchserve.sampling_params import SamplingParams
    from batchserve.worker.input_batch import RequestTable

    assert gpu.available(), "triton is not importable"
    rows, rng = [], random.Random(0)
    seqs = [(700, 1), (33, 1), (1, 1), (1500, 1), (0, 300), (257, 64), (900, 17)]
    block_size = 16
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 8
    for (heads, kv_heads, head_dim), dtype in [(h, d) for h in ((9, 3, 64), (32, 8, 128))
                                               for d in (torch.bfloat16, torch.float16, torch.float32)]:  # fmt: skip
        free = list(range(num_blocks))
        rng.shuffle(free)
        new = []
        for i, (cached, n) in enumerate(seqs):
            blocks = [free.pop() for _ in range(-(-(cached + n) // block_size))]
            new.append(NewRequestData(f"r{i}", [3] * (cached + n), cached + n, SamplingParams(), blocks, cached))
        step = SchedulerOutput(new_requests=new, num_scheduled_tokens={r.req_id: n for r, (_, n) in zip(new, seqs)})
        table = RequestTable(block_size)
        table.apply(step)
        meta = table.build(step, torch.device(device)).attn_metadata
        shape = (num_blocks, block_size, kv_heads, head_dim)
        pool = tuple(torch.randn(shape, device=device).to(dtype) for _ in range(2))
        query = torch.randn(meta.slot_mapping.shape[0], heads, head_dim, device=device).to(dtype)
        key, value = (c.view(-1, kv_heads, head_dim)[meta.slot_mapping] for c in pool)
        out = {}
        for name in ("torch", "triton"):
            with mode("before" if name == "torch" else "after"):
                out[name] = attention.paged_attention(query, key, value, pool, meta, head_dim**-0.5).float()
        error = (out["torch"] - out["triton"]).abs().max().item()
        rows.append({"heads": [heads, kv_heads, head_dim], "dtype": str(dtype), "max_abs_error": error,
                     "ok": error < (1e-4 if dtype == torch.float32 else 3e-2)})  # fmt: skip
    return {"rows": rows, "all_ok": all(r["ok"] for r in rows)}


def time_call(call, device: str, repeats: int = 200) -> float:
    """Microseconds a call, the mean of `repeats` after one warm-up."""
    call()
    sync(device)
    start = time.perf_counter()
    for _ in range(repeats):
        call()
    sync(device)
    return (time.perf_counter() - start) / repeats * 1e6


@torch.no_grad()
def fused_norm_check(device: str, dtype: str, shapes=((1, 576), (256, 576), (64, 4096), (2048, 4096))) -> dict:
    """RMSNorm + residual: torch's code (layers/norm.py on the GPU) against the fused Triton kernel, microseconds a
    call at decode and prefill shapes (SmolLM2's hidden 576, Llama-3.1-8B's 4096), and their largest difference."""
    from batchserve.layers.gpu import fused_norm
    from batchserve.layers.norm import RMSNorm

    rows, torch_dtype = [], getattr(torch, dtype)
    for num_rows, hidden in shapes:
        norm = RMSNorm(hidden, 1e-5, torch_dtype).to(device)
        x, residual = (torch.randn(num_rows, hidden, device=device).to(torch_dtype) for _ in range(2))
        calls = {
            "torch": functools.partial(lambda n, a, r: n(a, r.clone()), norm, x, residual),
            "triton": functools.partial(lambda w, a, r: fused_norm.rms_norm(a, w, 1e-5, r.clone()), norm.weight, x,
                                        residual),
        }  # fmt: skip
        row = {
            "rows": num_rows,
            "hidden": hidden,
            **{f"{name}_us": time_call(call, device) for name, call in calls.items()},
        }
        row["max_abs_difference"] = (calls["torch"]()[0].float() - calls["triton"]()[0].float()).abs().max().item()
        rows.append(row)
    return {"dtype": dtype, "rows": rows, "note": "each call includes one clone of the residual (both sides)"}


def parity(model: str, device: str, count: int, new_tokens: int, rng: random.Random) -> dict:
    """batchserve (one batch, the "after" configuration) vs transformers (one request at a time), float32."""
    from transformers import AutoModelForCausalLM

    engine = engine_for(model, device, "float32", max_batch_size=count, kv_cache_memory_fraction=0.3)
    requests = prompts(count, rng, 20, 300, engine.model_config.vocab_size)
    for i, prompt in enumerate(requests):
        submit(engine, str(i), prompt, new_tokens)
    ours: dict[int, list[int]] = {i: [] for i in range(count)}
    while engine.has_unfinished_requests():
        for delta in engine.step():
            ours[int(delta.request_id)] += delta.delta_token_ids
    release(engine)
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).to(device).eval()
    same, rows = 0, []
    for i, prompt in enumerate(requests):
        with torch.inference_mode():
            ids = torch.tensor([prompt], device=device)
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                              eos_token_id=None, pad_token_id=0)  # fmt: skip
        theirs = out[0, len(prompt) :].tolist()
        agree = next((k for k, (a, b) in enumerate(zip(ours[i], theirs)) if a != b), min(len(ours[i]), new_tokens))
        same += agree == new_tokens
        rows.append({"prompt_len": len(prompt), "tokens_in_agreement": agree})
    del hf
    return {"requests": count, "identical": same, "rows": rows}


def decode_steps(engine, batch: int, context: int, steps: int, rng: random.Random, device: str) -> dict:
    """Fill the batch with `context`-token prompts, then time `steps` decode steps (median) and profile a few."""
    from torch.profiler import ProfilerActivity, profile

    # the first admitted decode while the rest prefill: enough tokens that none finishes before the timed steps end
    prefill_steps = -(-batch * context // engine.config.scheduler.max_num_tokens)
    for i, prompt in enumerate(prompts(batch, rng, context, context, engine.model_config.vocab_size)):
        submit(engine, f"d{i}", prompt, steps + prefill_steps + 16)
    while engine.scheduler.num_waiting or engine.last_stats is None or engine.last_stats.num_prefill_tokens:
        engine.step()
    engine.step()  # warm-up
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()  # returns once the sampled ids are on the host: the step is complete
        times.append(time.perf_counter() - start)
    profiled = 4
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(profiled):
            engine.step()
    counts = {e.key: e.count / profiled for e in prof.key_averages() if e.key.startswith(("cu", "aten::_local"))}
    step = statistics.median(times)
    graphs = getattr(engine.runner, "decode_graphs", None)
    decoding = engine.last_stats.num_decode_tokens  # the batch still decoding at the end (all of it, as planned)
    return {"batch": batch, "context": context, "step_ms": step * 1e3, "tok_per_s": decoding / step,
            "decoding_at_end": decoding,
            "launches_per_step": sum(counts.get(k, 0) for k in LAUNCHES),
            "syncs_per_step": sum(counts.get(k, 0) for k in SYNCS), "runtime_calls_per_step": counts,
            "graph_replays": dict(graphs.replays) if graphs is not None else {}}  # fmt: skip


def decode(model: str, device: str, dtype: str, name: str, batches: list[int], context: int, steps: int, rng) -> list:
    """Decode rows of one configuration (MODES), a fresh engine per batch size."""
    rows = []
    for batch in batches:
        with mode(name) as options:
            engine = engine_for(model, device, dtype, max_batch_size=batch, max_num_tokens=max(2048, batch),
                                kv_cache_memory_fraction=0.3, **options)  # fmt: skip
            row = decode_steps(engine, batch, context, steps, rng, device)
            release(engine)
        rows.append(row)
        print(f"decode {name} B={batch}: {row['step_ms']:.2f} ms/step, {row['tok_per_s']:.0f} tok/s, "
              f"{row['launches_per_step']:.0f} launches, {row['syncs_per_step']:.0f} syncs", flush=True)  # fmt: skip
    return rows


def ttft_of(engine, prompt_len: int, repeats: int, rng: random.Random) -> dict:
    times = []
    for r in range(repeats + 1):  # the first is a warm-up
        submit(engine, f"t{r}", prompts(1, rng, prompt_len, prompt_len, engine.model_config.vocab_size)[0], 1)
        start = time.perf_counter()
        while not any(delta.delta_token_ids for delta in engine.step()):
            pass
        if r:
            times.append(time.perf_counter() - start)
    return {"prompt_len": prompt_len, "ttft_ms": statistics.median(times) * 1e3, "runs": len(times)}


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Device-to-device copy: bytes read + written per second (the median of 10 copies)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(11):
        sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        sync(device)
        times.append(time.perf_counter() - start)
    return 2 * nbytes / statistics.median(times[1:])


def big(shapes_name: str, device: str, dtype: str, batches: list[int], context: int, steps: int, ttft_len: int,
        rng: random.Random) -> dict:  # fmt: skip
    shapes = BIG_SHAPES[shapes_name]
    bandwidth = copy_bandwidth(device, 2 * 1024**3 if device == "cuda" else 64 * 1024**2)
    result = {"shapes": shapes_name, "copy_bandwidth_gb_s": bandwidth / 1e9, "rows": []}
    with mode("after") as options:
        engine = big_engine(shapes, device, dtype, max_batch_size=max(batches), max_num_tokens=max(2048, ttft_len),
                            kv_cache_memory_fraction=0.5, **options)  # fmt: skip
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
        bound_ms = weight_bytes / bandwidth * 1e3
        result.update(weight_bytes=weight_bytes, weight_streaming_bound_ms=bound_ms)
        result["ttft"] = ttft_of(engine, ttft_len, 2, rng)
        for batch in batches:
            row = decode_steps(engine, batch, context, steps, rng, device)
            row["x_bound"] = row["step_ms"] / bound_ms
            result["rows"].append(row)
            print(f"{shapes_name} B={batch}: {row['step_ms']:.2f} ms/step = {row['x_bound']:.2f}x the weight-streaming "
                  f"bound ({bound_ms:.2f} ms)", flush=True)  # fmt: skip
            while engine.has_unfinished_requests():
                engine.step()
        release(engine)
    return result


def ttft(model: str, device: str, dtype: str, prompt_len: int, rng: random.Random) -> dict:
    with mode("after") as options:
        engine = engine_for(model, device, dtype, max_num_tokens=max(2048, prompt_len), kv_cache_memory_fraction=0.3,
                            **options)  # fmt: skip
        result = ttft_of(engine, prompt_len, 3, rng)
        release(engine)
    return result


# --- the run -------------------------------------------------------------------------------------------------------
class Run:
    """The result being built: each section runs on its own (a failure is recorded with its traceback and the next
    runs), none starts past the time budget, and the JSON is rewritten after each (a cut-short run keeps figures)."""

    def __init__(self, result: dict, path: Path, budget_s: float) -> None:
        self.result, self.path, self.deadline = result, path, time.monotonic() + budget_s
        path.parent.mkdir(parents=True, exist_ok=True)

    def section(self, name: str, fn, *args) -> None:
        start = time.monotonic()
        if start > self.deadline:
            self.result[name] = {"error": "skipped: past the time budget (--budget-s)"}
        else:
            try:
                self.result[name] = fn(*args)
            except Exception as exc:  # a one-shot device session must keep the other figures
                self.result[name] = {"error": repr(exc), "traceback": traceback.format_exc()}
                print(f"{name} FAILED: {exc!r}", flush=True)
        self.result.setdefault("section_seconds", {})[name] = round(time.monotonic() - start, 1)
        self.path.write_text(json.dumps(self.result, indent=1))


def table(result: dict) -> str:
    """The figures against the issue's targets, as a markdown table."""
    lines = ["| figure | value | target |", "|---|---|---|"]

    def row(name, value, target=""):
        lines.append(f"| {name} | {value} | {target} |")

    env = result.get("environment", {})
    row("device", f"{env.get('gpu', env.get('device'))}, driver {env.get('driver', '-')}, torch {env.get('torch')}, "
        f"triton {env.get('triton', '-')}")  # fmt: skip
    kernels = result.get("kernels", {})
    if kernels:
        row("Triton kernels = torch path", kernels.get("all_ok", kernels.get("error")), "True")
    for r in result.get("fused_norm", {}).get("rows", []):
        row(f"RMSNorm+residual {r['rows']}x{r['hidden']}: torch / Triton",
            f"{r['torch_us']:.1f} / {r['triton_us']:.1f} us")  # fmt: skip
    par = result.get("parity", {})
    row("greedy float32 parity", f"{par.get('identical')}/{par.get('requests')}" if "requests" in par else par,
        "all identical")  # fmt: skip
    for name in ("before", "after"):
        rows = result.get(f"decode_{name}")
        for r in rows if isinstance(rows, list) else []:
            target = {1: "<= 1.5 ms", 256: ">= 60,000 tok/s"}.get(r["batch"], "") if name == "after" else ""
            row(f"SmolLM2 decode {name} B={r['batch']} ctx {r['context']}",
                f"{r['step_ms']:.2f} ms, {r['tok_per_s']:,.0f} tok/s, {r['launches_per_step']:.0f} launches, "
                f"{r['syncs_per_step']:.0f} syncs", target)  # fmt: skip
    b = result.get("big", {})
    for r in b.get("rows", []):
        target = {1: "<= 1.3x", 64: "<= 2x"}.get(r["batch"], "")
        row(f"{b['shapes']} B={r['batch']} step", f"{r['step_ms']:.2f} ms = {r['x_bound']:.2f}x bound "
            f"({b['weight_streaming_bound_ms']:.2f} ms at {b['copy_bandwidth_gb_s']:.0f} GB/s)", target)  # fmt: skip
    if "ttft" in b:
        row(f"{b['shapes']} TTFT {b['ttft']['prompt_len']} tokens", f"{b['ttft']['ttft_ms']:.1f} ms")
    t = result.get("ttft", {})
    if "ttft_ms" in t:
        row(f"SmolLM2 TTFT {t['prompt_len']} tokens", f"{t['ttft_ms']:.1f} ms")
    for name, value in result.items():
        if isinstance(value, dict) and "error" in value:
            row(f"{name} FAILED", value["error"][:100])
    return "\n".join(lines)


def arguments() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16", help="dtype of the timings (parity is float32)")
    ap.add_argument("--batch-sizes", default="1,64,256")
    ap.add_argument("--context", type=int, default=512, help="tokens of context of the decode runs")
    ap.add_argument("--decode-steps", type=int, default=32)
    ap.add_argument("--ttft-len", type=int, default=2048)
    ap.add_argument("--parity-requests", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=32, help="greedy tokens per parity request")
    ap.add_argument("--big", default="llama-3.1-8b", choices=[*BIG_SHAPES, "none"])
    ap.add_argument("--big-batch-sizes", default="1,64")
    ap.add_argument("--smoke", action="store_true", help="tiny everything: the CPU smoke test of this script")
    ap.add_argument("--budget-s", type=float, default=420, help="no section starts after this many seconds")
    ap.add_argument("--out", type=Path, default=Path("bench_results"))
    args = ap.parse_args()
    if args.smoke:
        args.batch_sizes, args.context, args.decode_steps, args.ttft_len = "1,4", 24, 3, 64
        args.parity_requests, args.new_tokens, args.big, args.big_batch_sizes = 2, 4, "tiny", "1,2"
    return args


def main() -> None:
    args = arguments()
    from batchserve.config import EngineConfig
    from batchserve.host.process import configure_torch

    configure_torch(None, EngineConfig().seed)  # once, for every engine of the process; torch's thread count
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False  # float32 means float32
    rng = random.Random(0)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "environment": environment(args.device)}
    print(json.dumps(result["environment"]), flush=True)
    run = Run(result, args.out / f"gpu_check-{args.device}-{time.strftime('%Y%m%d-%H%M%S')}.json", args.budget_s)
    steps = args.decode_steps
    with tempfile.TemporaryDirectory() as tmp:  # most important first: a run cut short loses the least
        model = str(random_checkpoint(Path(tmp), SMOKE_SHAPES if args.smoke else SMOLLM2_135M))
        if args.device == "cuda":
            run.section("kernels", kernel_check, args.device)
        if args.device == "cuda":
            run.section("fused_norm", fused_norm_check, args.device, args.dtype)
        run.section("parity", parity, model, args.device, args.parity_requests, args.new_tokens, rng)
        run.section("decode_after", decode, model, args.device, args.dtype, "after", batches, args.context, steps, rng)
        if args.big != "none":
            big_batches = [int(b) for b in args.big_batch_sizes.split(",")]
            run.section("big", big, args.big, args.device, args.dtype, big_batches, args.context, steps, args.ttft_len,
                        rng)  # fmt: skip
        run.section("ttft", ttft, model, args.device, args.dtype, args.ttft_len, rng)
        run.section("decode_before", decode, model, args.device, args.dtype, "before", batches, args.context, steps,
                    rng)  # fmt: skip
    result["table"] = table(result)
    print(result["table"], flush=True)
    run.path.write_text(json.dumps(result, indent=1))
    (args.out / "gpu_check.md").write_text(result["table"] + "\n")
    print(f"saved {run.path} and {args.out / 'gpu_check.md'}")


if __name__ == "__main__":
    main()
