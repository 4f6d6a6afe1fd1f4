"""How close batchserve comes to this host's limits on long contexts and 8B shapes: each figure, its bound, the ratio.

    .venv/bin/python benchmarks/limits.py                                   # every section, bf16, 2 threads
    .venv/bin/python benchmarks/limits.py --sections prefill,decode --contexts 8192 --threads 1
    .venv/bin/python benchmarks/limits.py --sections 8b --layers 4 --eightb-batches 1,32

Sections (--sections, comma-separated):
  prefill  the default model (or --model) prefills one prompt of each --contexts length in chunks of
           --max-num-tokens; bound: the matmul FLOPs at torch's GEMM rate measured at M = the chunk size on the
           model's own shapes (benchmarks/roofline.py's timing), plus the causal attention FLOPs (QK^T and PV over the
           lower triangle) at that same rate.
  decode   --batches sequences, each with --contexts tokens of its own context, decode together; the step time is
           the median of --decode-steps steps once every sequence is decoding; bound: (the weights one step reads +
           every sequence's K/V) / the memory bandwidth measured here (benchmarks/model_scale.py's best pass over a
           1 GiB buffer). --shared-context: the sequences share all but the last 16 tokens of their context (one
           prefill instead of --batches; each still reads its K/V every step, from the shared blocks).
  8b       Llama-3.1-8B shapes (random bf16 weights, --layers of its 32 layers, the embedding and lm_head whole),
           --eightb-batches sequences of 32-token prompts decoding; batch 1 against the bandwidth bound, larger
           batches against the compute bound (the GEMM rate measured at that M on the 8B shapes, the lm_head
           included). Ratios hold for the reduced model; the 32-layer step is extrapolated and marked so.
           --eightb-formats int8,gguf:Q4_0 adds the weights kept quantized (int8 at load; the checkpoint written as
           a GGUF file and run as stored), batch 1 against the bytes of that format. --llama-cpp adds, for each
           GGUF file, llama.cpp's batch-1 decode on it (llama-bench) as a row whose ratio is batchserve over llama.cpp.
  peer64   the default model (always: the bound is roofline.py's, on its shapes) on benchmarks/workloads/peer64.json
           (64 sequences at once), its time against the step roofline of the steps it ran (roofline.step_roofline):
           per step the larger of its matmul time at torch's GEMM rates measured now at M = --peer-ms (interpolated
           between them) and the weights + K/V it reads at the measured bandwidth.
  Contexts past the default model's 8,192 positions run it with its config's max_position_embeddings raised (the
  same weights and shapes; positions reach only RoPE, whose cost does not depend on them).
Before anything is allocated the memory a row needs (weights + its K/V pool) is checked against --memory-gib; a row
that does not fit is printed as skipped with the sizes. Prints the host (CPU family, model, flags), a table and saves
JSON under bench_results/. Wall times on a loaded host are pessimistic; the load average is recorded.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import model_scale
import roofline
import torch

from batchserve.bench.machine import describe, machine_info

RESULTS = Path(__file__).resolve().parent.parent / "bench_results"
GIB = 1024**3
DEFAULT_POSITIONS = 8192  # the default model's context (SmolLM2-135M-Instruct)


@dataclasses.dataclass
class Row:
    section: str
    label: str
    figure: float | None = None  # seconds (prefill) or seconds per step (decode)
    bound: float | None = None
    note: str = ""

    @property
    def ratio(self) -> float | None:
        return self.bound / self.figure if self.figure and self.bound else None


def shapes_of(config, name: str) -> model_scale.Shapes:
    return model_scale.Shapes(name, config.vocab_size, config.hidden_size, config.intermediate_size,
                              config.num_layers, config.num_heads, config.num_kv_heads, config.head_dim,
                              tie_word_embeddings=config.tie_word_embeddings)  # fmt: skip


def layer_shapes(s: model_scale.Shapes) -> dict[str, tuple[int, int]]:
    h, q, kv = s.hidden_size, s.num_heads * s.head_dim, s.num_kv_heads * s.head_dim
    return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * s.intermediate_size),
            "down": (s.intermediate_size, h)}  # fmt: skip


def kv_bytes(s: model_scale.Shapes, tokens: int, element: int) -> int:
    return 2 * s.num_layers * s.num_kv_heads * s.head_dim * element * tokens


def weight_bytes(s: model_scale.Shapes, element: int) -> int:
    return sum(model_scale._numel(shape) for _, shape in s.all_tensors()) * element


def gemm_rate(s: model_scale.Shapes, m: int, dtype, min_time: float, lm_head: bool, clock) -> tuple[float, float]:
    """(seconds, FLOPs) of one step's matmuls at M rows on these shapes, timed over distinct weight copies per layer
    (roofline.time_matmuls: the faster of the layouts torch offers)."""
    copies = min(s.num_layers, 8)  # enough distinct copies that a layer's weights are not still in cache
    seconds = flops = 0.0
    for k, n in layer_shapes(s).values():
        seconds += s.num_layers * roofline.time_matmuls(m, (k, n), copies, dtype, min_time, clock)
        flops += s.num_layers * 2 * m * k * n
    if lm_head:
        seconds += roofline.time_matmuls(m, (s.hidden_size, s.vocab_size), 1, dtype, min_time, clock)
        flops += 2 * m * s.hidden_size * s.vocab_size
    return seconds, flops


def attention_flops(s: model_scale.Shapes, context: int) -> float:
    """QK^T and PV over the causal triangle of one prompt, every layer: 2 products x 2 FLOPs x heads x dim x n^2/2."""
    return 2.0 * s.num_layers * s.num_heads * s.head_dim * context * context


def beyond_context(config, tokens: int) -> str:
    limit = config.max_position_embeddings
    return f"refused: the model's context is {limit} tokens" if tokens > limit else ""


def fits(need: float, args) -> str:
    return (
        "" if need <= args.memory_gib * GIB else f"skipped: needs {need / GIB:.1f} GiB > --memory-gib {args.memory_gib}"
    )


def new_engine(args, model: str | None, **options):
    from batchserve.engine.llm_engine import LLMEngine

    if model:
        options["model"] = model
    options.setdefault("enable_prefix_caching", False)
    return LLMEngine.from_options(device="cpu", dtype=args.dtype, num_threads=args.threads, **options)


def default_model_with_positions(positions: int, folder: Path) -> Path:
    """The default model with its context raised to `positions`, for contexts past its 8,192: links to its converted
    files and a config.json whose max_position_embeddings is raised. Positions reach only RoPE, whose cost does not
    depend on them, so the speed is the default model's (its answers past 8,192 tokens are not the point)."""
    from batchserve.models.loader import default_model_path, ensure_gguf_cache

    converted = ensure_gguf_cache(default_model_path())
    folder.mkdir(parents=True, exist_ok=True)
    for item in converted.iterdir():
        if item.name != "config.json":
            (folder / item.name).symlink_to(item)
    config = json.loads((converted / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "max_position_embeddings": positions}, indent=1))
    return folder


def preset_checkpoint(args, preset: str, folder: Path, dtype) -> tuple[str, str]:
    """--model preset:<name>: random weights of a model_scale preset's shapes with --layers of its layers."""
    if preset not in model_scale.PRESETS:
        raise SystemExit(f"--model preset:{preset}: choose from {', '.join(sorted(model_scale.PRESETS))}")
    full = model_scale.PRESETS[preset]
    shapes = dataclasses.replace(full, num_layers=min(args.layers, full.num_layers))
    model_scale.write_checkpoint(shapes, folder, dtype)
    return str(folder), f"{full.name} ({shapes.num_layers} of {full.num_layers} layers)"


def prompt(vocab: int, length: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=g).tolist()


def run_prefill(engine, tokens: list[int], clock) -> float:
    """Seconds from adding the prompt to its first token."""
    from batchserve.sampling_params import SamplingParams

    start = clock()
    engine.add_prompt("prefill", tokens, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    return clock() - start


def decode_step_s(engine, prompts: list[list[int]], steps: int, clock) -> float:
    """Median seconds of a step in which every sequence decodes (after all prompts have produced a token). The first
    prompt runs alone until its first token, so that prompts sharing its prefix find it cached."""
    from batchserve.sampling_params import SamplingParams

    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    ids = [f"d{i}" for i in range(len(prompts))]
    started: set[str] = set()
    for first, last in ((0, 1), (1, len(ids))):
        for i in range(first, last):
            engine.add_prompt(ids[i], prompts[i], params)
        while not started.issuperset(ids[first:last]):
            started.update(o.request_id for o in engine.step() if o.delta_token_ids)
    samples = []
    for _ in range(steps):
        t0 = clock()
        engine.step()
        samples.append(clock() - t0)
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return statistics.median(samples)


def decode_prompts(args, vocab: int, context: int, batch: int) -> list[list[int]]:
    """Each sequence's own context; with --shared-context, one context whose last 16 tokens differ per sequence (a
    prefill of each 32k context takes minutes): the step reads each sequence's K/V as before, from shared blocks."""
    if not args.shared_context:
        return [prompt(vocab, context, 10 + i) for i in range(batch)]
    common = prompt(vocab, context - 16, 10)
    return [common + prompt(vocab, 16, 100 + i) for i in range(batch)]


def probe_model(args):
    """The shapes and config of the rows' model, from an engine closed and dropped at once (its pool freed)."""
    probe = new_engine(args, args.model, num_kv_blocks=8)
    probe.close()
    return shapes_of(probe.model_config, args.model_label), probe.model_config


def section_prefill(args, dtype, element) -> list[Row]:
    rows = []
    s, config = probe_model(args)
    seconds, flops = gemm_rate(s, args.max_num_tokens, dtype, args.min_time, False, args.clock)
    rate = flops / seconds
    print(f"prefill: matmuls at M={args.max_num_tokens} run at {rate / 1e9:.0f} GFLOP/s on these shapes", flush=True)
    for context in args.contexts:
        label = f"{s.name} prefill {context}"
        skip = fits(weight_bytes(s, element) + kv_bytes(s, context + 64, element), args) or beyond_context(
            config, context + 1
        )
        if skip:
            rows.append(Row("prefill", label, note=skip))
            continue
        bound = (context * flops / args.max_num_tokens + attention_flops(s, context)) / rate
        try:
            engine = new_engine(args, args.model, num_kv_blocks=context // 16 + 4, max_num_tokens=args.max_num_tokens,
                                max_model_len=max(context + 16, 2048))  # fmt: skip
        except ValueError as e:
            rows.append(Row("prefill", label, bound=bound, note=f"refused: {e}"))
            continue
        run_prefill(engine, prompt(s.vocab_size, 64, 0), args.clock)  # warm-up
        seconds = run_prefill(engine, prompt(s.vocab_size, context, 1), args.clock)
        engine.close()
        rows.append(
            Row("prefill", label, seconds, bound, f"attention {attention_flops(s, context) / rate:.1f} s of it")
        )
        report(rows[-1])
    return rows


def section_decode(args, element, bandwidth) -> list[Row]:
    rows = []
    s, config = probe_model(args)
    for context in args.contexts:
        for batch in args.batches:
            label = f"{s.name} decode batch {batch} context {context}"
            kv = kv_bytes(
                s, (1 if args.shared_context else batch) * context + batch * (args.decode_steps + 16), element
            )
            skip = fits(weight_bytes(s, element) + kv, args) or beyond_context(config, context + args.decode_steps + 8)
            if skip:
                rows.append(Row("decode", label, note=skip))
                continue
            bound = (s.step_params(batch) * element + kv_bytes(s, batch * context, element)) / bandwidth
            own = batch if not args.shared_context else 1  # copies of the context in the pool
            blocks = own * (context // 16 + 1) + batch * ((args.decode_steps + 40) // 16 + 2)
            try:
                engine = new_engine(args, args.model, num_kv_blocks=blocks, max_batch_size=batch,
                                    max_num_tokens=args.max_num_tokens, max_model_len=max(context + 64, 2048),
                                    enable_prefix_caching=args.shared_context)  # fmt: skip
            except ValueError as e:
                rows.append(Row("decode", label, bound=bound, note=f"refused: {e}"))
                continue
            step = decode_step_s(
                engine, decode_prompts(args, s.vocab_size, context, batch), args.decode_steps, args.clock
            )
            engine.close()
            rows.append(Row("decode", label, step, bound, f"K/V {kv_bytes(s, batch * context, element) / GIB:.2f} GiB"))
            report(rows[-1])
    return rows


def step_weight_bytes(s: model_scale.Shapes, fmt: str, element: int, folder: Path) -> float:
    """What one batch-1 step reads of the weights in format `fmt`: none as written; int8 the decoder layers' codes
    (1 byte) and float32 per-channel scales, the lm_head and norms as written (layers/quantization.py quantizes the
    layers' projections only); gguf:<type> every tensor of the file as stored but the embedding table."""
    if fmt == "none":
        return s.step_params(1) * element
    if fmt == "int8":
        layers = [shape for i in range(s.num_layers) for _, shape in s.layer_tensors(i) if len(shape) == 2]
        quantized = sum(n * k + 4 * n for n, k in layers)
        return quantized + (s.step_params(1) - sum(n * k for n, k in layers)) * element
    import gguf

    reader = gguf.GGUFReader(str(model_scale.engine_source(folder, fmt)[0]))
    return float(sum(int(t.n_bytes) for t in reader.tensors if t.name != "token_embd.weight"))


def section_8b(args, dtype, element, bandwidth) -> list[Row]:
    full = model_scale.PRESETS[args.eightb_preset]
    s = dataclasses.replace(full, name=f"{full.name} ({args.layers} of {full.num_layers} layers)",
                            num_layers=args.layers)  # fmt: skip
    kv = kv_bytes(s, max(args.eightb_batches) * 64, element)
    skip = fits(2 * weight_bytes(s, element) + kv, args)  # the checkpoint's pages and the engine's copy
    if skip:
        return [Row("8b", s.name, note=skip)]
    folder = Path(tempfile.mkdtemp(prefix="limits_8b_"))
    rows = []
    try:
        model_scale.write_checkpoint(s, folder, dtype)
        model_scale.scale_gguf.write_ggufs(folder, model_scale.gguf_types(args.eightb_formats))
        for fmt in args.eightb_formats:
            rows += _rows_8b(args, s, full, fmt, folder, dtype, element, bandwidth)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return rows


def _rows_8b(args, s, full, fmt: str, folder: Path, dtype, element, bandwidth) -> list[Row]:
    """Batch 1 against the bandwidth bound (the format's bytes), larger batches against the bf16 GEMMs' compute bound."""
    model, tokenizer, quantization = model_scale.engine_source(folder, fmt)
    engine = new_engine(args, str(model), num_kv_blocks=max(args.eightb_batches) * 4 + 8, tokenizer=tokenizer,
                        max_batch_size=max(args.eightb_batches), quantization=quantization)  # fmt: skip
    rows = []
    for batch in args.eightb_batches:
        prompts = [prompt(s.vocab_size, 32, 20 + i) for i in range(batch)]
        step = decode_step_s(engine, prompts, args.decode_steps, args.clock)
        if batch == 1:
            bound, kind = step_weight_bytes(s, fmt, element, folder) / bandwidth, "bandwidth"
        else:
            bound = gemm_rate(s, batch, dtype, args.min_time, True, args.clock)[0]
            kind = f"bf16 compute at M={batch}"
        full_step = step * full.step_params(batch) / s.step_params(batch)
        # scaled by parameters only where every weight has the same bytes a parameter
        note = (
            f"32 layers ~{1e3 * full_step:.0f} ms/step (scaled by params)" if fmt == "none" else "the reduced model's"
        )
        rows.append(Row("8b", f"{s.name} {fmt} batch {batch} vs {kind}", step, bound, note))
        report(rows[-1])
        if batch == 1 and args.llama_cpp and fmt.startswith("gguf:"):
            rows.append(_llama_cpp_row(args, s, fmt, model, step))
            report(rows[-1])
    engine.close()
    return rows


def _llama_cpp_row(args, s, fmt: str, path: Path, step: float) -> Row:
    """llama.cpp's batch-1 decode on the same GGUF file (llama-bench, the same threads, wall clock) as the bound:
    the ratio is then batchserve's speed over llama.cpp's. From an empty context (batchserve's step follows a 32-token
    prompt): this build's AMX weight repacking crashes llama-bench's prompt step on the AMX host, and turning the
    repacking off would slow llama.cpp's own decode."""
    bench = model_scale.scale_gguf.llama_bench(path, args.threads, tokens=32, depth=0)
    note = f"llama.cpp {bench['tok_s']:.2f} +- {bench['sd_tok_s']:.2f} tok/s (llama-bench, build {bench['build']})"
    if args.clock is time.process_time:
        note += "; batchserve on the CPU clock, llama.cpp on the wall: compare with --clock wall"
    return Row("8b", f"{s.name} {fmt} batch 1 vs llama.cpp", step, 1.0 / bench["tok_s"], note)


def section_peer64(args, bandwidth: float) -> list[Row]:
    from batchserve.entrypoints.llm import LLM
    from batchserve.sampling_params import SamplingParams

    requests = json.loads(args.workload.read_text())["requests"][: args.peer_limit or None]
    if args.peer_max_tokens:
        requests = [{**r, "max_tokens": min(r["max_tokens"], args.peer_max_tokens)} for r in requests]
    llm = LLM(None, dtype=args.dtype, num_threads=args.threads, record_steps=True)  # roofline.py's shapes
    llm.engine.reserve_kv_blocks(llm.engine.max_kv_blocks)
    params = [SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=r["max_tokens"]) for r in requests]
    llm.generate([{"prompt_token_ids": requests[0]["prompt_token_ids"]}], params[0], use_tqdm=False)  # warm-up
    warm_steps = len(llm.engine.step_records)
    t0 = args.clock()
    llm.generate([{"prompt_token_ids": r["prompt_token_ids"]} for r in requests], params, use_tqdm=False)
    wall = args.clock() - t0
    steps = [step_shape(record.stats) for record in llm.engine.step_records[warm_steps:]]
    del llm
    measured = roofline.measure(args.dtype, sorted(set(args.peer_ms)), args.min_time, args.clock)
    bound = roofline.step_roofline(measured, args.dtype, steps, bandwidth)
    note = (f"step roofline: {bound['compute_bound_steps']} of {bound['steps']} steps matmul-bound; matmuls "
            f"{bound['matmul_s']:.2f} s, bytes {bound['memory_s']:.2f} s in all")  # fmt: skip
    row = Row("peer64", f"default model {args.workload.stem} ({len(requests)} requests)", wall, bound["bound_s"], note)
    report(row)
    return [row]


def step_shape(stats) -> tuple[int, int, int]:
    """(rows through the layers, rows through the lm_head, tokens of K/V read) of one engine step, from its
    scheduler's snapshot: every scheduled sequence samples, attention reads each running sequence's filled slots."""
    tokens = stats.num_prefill_tokens + stats.num_decode_tokens
    return tokens, stats.num_scheduled_seqs, stats.kv_slots_filled


def report(row: Row) -> None:
    print(format_row(row), flush=True)


def format_row(r: Row) -> str:
    if r.figure is None:
        return f"{r.section:<8} {r.label:<58} {'':>10} {'':>10} {'':>6}  {r.note}"
    ratio = f"{r.ratio:.2f}" if r.ratio else "-"
    bound = f"{1e3 * r.bound:.1f}" if r.bound else "-"
    return f"{r.section:<8} {r.label:<58} {1e3 * r.figure:>10.1f} {bound:>10} {ratio:>6}  {r.note}"


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ints = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    ap.add_argument("--sections", default="prefill,decode,8b,peer64")
    ap.add_argument("--contexts", type=ints, default=[8192, 32768], help="prompt / context lengths")
    ap.add_argument("--batches", type=ints, default=[1, 8], help="decode batch sizes at each context")
    ap.add_argument("--layers", type=int, default=4, help="layers of the 8B shapes actually built")
    ap.add_argument("--eightb-batches", type=ints, default=[1, 32])
    ap.add_argument(
        "--eightb-formats",
        type=lambda t: t.split(","),
        default=["none"],
        help="weight formats of the 8B rows: none (as written), int8, gguf:Q4_0 (gguf:Q8_0, gguf:Q4_1)",
    )
    ap.add_argument(
        "--llama-cpp",
        action="store_true",
        help="add llama.cpp's batch-1 decode (llama-bench, docs/quantization.md) on each gguf:<type> file of the 8B rows",
    )
    ap.add_argument("--eightb-preset", default="llama-3.1-8b", choices=sorted(model_scale.PRESETS))
    ap.add_argument("--model", default=None, help="the model of prefill and decode (default: the default model); "
                    "preset:<name> (e.g. preset:llama-3.1-8b): random weights of that model_scale preset, --layers of it")  # fmt: skip
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-num-tokens", type=int, default=2048, help="the prefill chunk (engine max_num_tokens)")
    ap.add_argument("--decode-steps", type=int, default=8)
    ap.add_argument("--shared-context", action="store_true",
                    help="decode: the sequences share their context but its last 16 tokens (one prefill)")  # fmt: skip
    ap.add_argument("--memory-gib", type=float, default=24.0, help="what a row may need (shared host)")
    ap.add_argument("--workload", type=Path, default=Path(__file__).resolve().parent / "workloads" / "peer64.json")
    ap.add_argument("--peer-limit", type=int, default=0, help="only the first N requests of the workload")
    ap.add_argument("--peer-max-tokens", type=int, default=0, help="cap each request's max_tokens (0: as written)")
    ap.add_argument(
        "--peer-ms",
        type=ints,
        default=[1, 2, 4, 8, 16, 32, 64, 128, 256, 512],
        help="GEMM rows timed for peer64's step roofline (interpolated between them)",
    )
    ap.add_argument("--min-time", type=float, default=0.2, help="seconds of samples per GEMM timing")
    ap.add_argument(
        "--clock",
        choices=["wall", "cpu"],
        default="wall",
        help="cpu: this process's CPU seconds (with --threads 1), which other load does not inflate",
    )
    ap.add_argument("--out", type=Path, default=None, help="JSON file (default: bench_results/limits-<time>.json)")
    return ap.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.clock == "cpu" and args.threads != 1:
        raise SystemExit("--clock cpu counts one thread's CPU seconds: use it with --threads 1")
    clock_name, args.clock = args.clock, time.process_time if args.clock == "cpu" else time.perf_counter
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    element = torch.empty((), dtype=dtype).element_size()
    sections = args.sections.split(",")
    args.model_label = args.model or "default model"
    long_folder = None
    if args.model and args.model.startswith("preset:"):
        long_folder = Path(tempfile.mkdtemp(prefix="limits_preset_"))
        args.model, args.model_label = preset_checkpoint(args, args.model.removeprefix("preset:"), long_folder, dtype)
    elif not args.model and {"prefill", "decode"} & set(sections) and max(args.contexts) + 64 > DEFAULT_POSITIONS:
        long_folder = Path(tempfile.mkdtemp(prefix="limits_positions_"))
        positions = max(args.contexts) + args.decode_steps + 1024
        args.model = str(default_model_with_positions(positions, long_folder / "model"))
        args.model_label = f"default model ({positions} positions)"
    info = machine_info(args.threads, args.dtype)
    load_before = os.getloadavg()[0]
    print(f"machine: {describe(info)}; load average {load_before:.2f}; clock {clock_name}", flush=True)
    bandwidth = model_scale.memory_bandwidth(args.threads, gib=0.5, clock=args.clock)
    torch.set_num_threads(args.threads)
    print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s ({args.threads} threads)", flush=True)
    print(f"{'section':<8} {'figure':<58} {'ms':>10} {'bound ms':>10} {'ratio':>6}  note")
    rows: list[Row] = []
    runners = {"prefill": lambda: section_prefill(args, dtype, element),
               "decode": lambda: section_decode(args, element, bandwidth),
               "8b": lambda: section_8b(args, dtype, element, bandwidth), "peer64": lambda: section_peer64(args, bandwidth)}  # fmt: skip
    try:
        for name in sections:
            if name not in runners:
                raise SystemExit(f"--sections: unknown section {name!r}; choose from {', '.join(runners)}")
            rows += runners[name]()
    finally:
        if long_folder:
            shutil.rmtree(long_folder, ignore_errors=True)
    print("\n" + "\n".join(format_row(r) for r in rows))
    record = {"machine": info, "bandwidth_gb_s": bandwidth / 1e9, "loadavg_before": load_before,
              "loadavg_after": os.getloadavg()[0], "clock": clock_name,
              "args": {k: str(v) for k, v in vars(args).items() if k != "clock"},
              "rows": [{**dataclasses.asdict(r), "ratio": r.ratio} for r in rows]}  # fmt: skip
    out = args.out or RESULTS / f"limits-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1))
    print(f"saved {out}")
    return record


if __name__ == "__main__":
    main()
