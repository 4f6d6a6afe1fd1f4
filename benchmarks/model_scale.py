"""Scale on this host: a random-weight model of real shapes, loaded and served, against the memory-bandwidth bound.

    .venv/bin/python benchmarks/model_scale.py --preset tiny-llama           # seconds: checks the script works
    .venv/bin/python benchmarks/model_scale.py --preset tiny-moe
    .venv/bin/python benchmarks/model_scale.py --preset llama-3.1-8b         # ~16 GB of bf16 weights written first
    .venv/bin/python benchmarks/model_scale.py --preset qwen3-moe-30b-a3b-e32-l24 --batches 1,32 --output-len 16
    .venv/bin/python benchmarks/model_scale.py --preset llama-3.1-8b --layers 8 --quantization none int8 --batches 1,64
    .venv/bin/python benchmarks/model_scale.py --preset llama-3.1-8b --layers 8 \
        --quantization none int8 int4 gguf:Q8_0 gguf:Q4_0 --llama-cpp --batches 1,64

Writes a Hugging Face folder (config.json, a word-level tokenizer over the vocab, safetensors shards written one at a
time, so the writer never holds the whole model) under --dir (default: a temporary folder, removed afterwards unless
--keep), then, in a fresh process (so its peak RSS is the engine's alone), starts the engine on it and reports:
load time (LLM(...) until ready), the peak RSS after loading and after serving (VmHWM), and decode tok/s at each batch
size (B requests of --prompt-len tokens, greedy, --output-len tokens each, all prefilled in the first step; decode
tok/s = the tokens after each request's first / the time from the first first token to the last finish).

The bound: memory bandwidth is measured here, before writing and after serving (the best pass over a 1 GiB float32
buffer, as a sum or a matrix-vector product, on the engine's thread count; a busy host only lowers it); one decode step of B sequences reads every weight once (the embedding table: B rows only), so its time
is at least step bytes / bandwidth and decode tok/s at most B * bandwidth / step bytes. For a MoE model the step reads
the layers' non-expert weights and the distinct experts the B tokens pick, E * (1 - (1 - k/E)^B) a layer under
uniform routing (random router weights route about uniformly). K/V reads are left out (short sequences here).
--quantization runs the engine once per weight format, each in its own fresh process, on the same checkpoint (none:
as written; int8 / int4: quantized at load; gguf:<type>, type Q8_0, Q4_0 or Q4_1: the checkpoint written as a GGUF
file of that type (benchmarks/scale_gguf.py, beside the checkpoint) and run as stored, quantization gguf, with the
checkpoint's tokenizer); the bound is for the written dtype, so quantized rows are compared with none's instead.
--llama-cpp adds llama.cpp's single-stream decode on each gguf:<type> file (llama-bench, --threads threads,
--output-len tokens generated after --prompt-len tokens of context, 3 repetitions) beside batchserve's batch-1 row on
the same file; --llama-server adds, at each larger batch size, `llama-server -np min(B, 32)` on each file
(benchmarks/llama_server_peer.py: B requests of random prompt ids sent at once, greedy) beside batchserve's run at B,
both as generated tokens / wall time from sending the requests (prefill included). Prints a table and a JSON line.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import scale_gguf
import torch

SHARD_BYTES = 2 * 1024**3


@dataclass
class Shapes:
    """The shapes of a decoder checkpoint: a Llama (dense) or a Qwen3-MoE (num_experts > 0)."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    tie_word_embeddings: bool = False
    hf_extra: dict = field(default_factory=dict)

    @property
    def moe(self) -> bool:
        return self.num_experts > 0

    def hf_config(self, dtype: str) -> dict:
        common = {
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim, "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": dtype, "bos_token_id": 1, "eos_token_id": 2,
        }  # fmt: skip
        if not self.moe:
            return {**common, "model_type": "llama", "architectures": ["LlamaForCausalLM"], **self.hf_extra}
        return {
            **common, "model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"],
            "num_experts": self.num_experts, "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [], **self.hf_extra,
        }  # fmt: skip

    def layer_tensors(self, i: int) -> list[tuple[str, tuple[int, ...]]]:
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        p = f"model.layers.{i}."
        tensors = [(p + "input_layernorm.weight", (h,)), (p + "post_attention_layernorm.weight", (h,)),
                   (p + "self_attn.q_proj.weight", (q, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                   (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, q))]  # fmt: skip
        if not self.moe:
            inter = self.intermediate_size
            return tensors + [(p + "mlp.gate_proj.weight", (inter, h)), (p + "mlp.up_proj.weight", (inter, h)),
                              (p + "mlp.down_proj.weight", (h, inter))]  # fmt: skip
        tensors += [(p + "self_attn.q_norm.weight", (self.head_dim,)), (p + "self_attn.k_norm.weight", (self.head_dim,)),
                    (p + "mlp.gate.weight", (self.num_experts, h))]  # fmt: skip
        inter = self.moe_intermediate_size
        for e in range(self.num_experts):
            x = f"{p}mlp.experts.{e}."
            tensors += [(x + "gate_proj.weight", (inter, h)), (x + "up_proj.weight", (inter, h)),
                        (x + "down_proj.weight", (h, inter))]  # fmt: skip
        return tensors

    def all_tensors(self) -> list[tuple[str, tuple[int, ...]]]:
        tensors = [("model.embed_tokens.weight", (self.vocab_size, self.hidden_size))]
        for i in range(self.num_layers):
            tensors += self.layer_tensors(i)
        tensors.append(("model.norm.weight", (self.hidden_size,)))
        if not self.tie_word_embeddings:
            tensors.append(("lm_head.weight", (self.vocab_size, self.hidden_size)))
        return tensors

    def expert_params(self) -> int:
        return 3 * self.hidden_size * self.moe_intermediate_size

    def step_params(self, batch: int) -> float:
        """Parameters one decode step of `batch` sequences reads (see the module docstring)."""
        total = sum(_numel(shape) for _, shape in self.all_tensors())
        embed = self.vocab_size * self.hidden_size
        read = total - (0 if self.tie_word_embeddings else embed) + batch * self.hidden_size
        if self.moe:
            e, k = self.num_experts, self.num_experts_per_tok
            distinct = e * (1 - (1 - k / e) ** batch)
            read -= self.num_layers * (e - distinct) * self.expert_params()
        return read


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


LLAMA_3_1_8B = dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32, num_heads=32,
                    num_kv_heads=8, head_dim=128)  # fmt: skip
LLAMA3_ROPE = {"max_position_embeddings": 131072, "rope_theta": 500000.0,
               "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 8192}}  # fmt: skip
# Qwen3-30B-A3B's layer shapes (hidden 2048, 32 q / 4 kv heads of 128, experts of 768, top-8 routing) with 32 of its
# 128 experts and 24 of its 48 layers: 4.7B parameters (9.4 GB in bf16), 1.7B read per token
QWEN3_30B_A3B_E32_L24 = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_layers=24, num_heads=32,
                             num_kv_heads=4, head_dim=128, num_experts=32, num_experts_per_tok=8,
                             moe_intermediate_size=768)  # fmt: skip
PRESETS = {
    "llama-3.1-8b": Shapes("Llama-3.1-8B shapes", **LLAMA_3_1_8B, hf_extra=LLAMA3_ROPE),
    "qwen3-moe-30b-a3b-e32-l24": Shapes("Qwen3-30B-A3B layer shapes, 32 experts, 24 layers",
                                        **QWEN3_30B_A3B_E32_L24, hf_extra={"rope_theta": 1e6}),
    "tiny-llama": Shapes("tiny Llama", vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=2,
                         num_heads=4, num_kv_heads=2, head_dim=32),
    "tiny-moe": Shapes("tiny Qwen3-MoE", vocab_size=512, hidden_size=128, intermediate_size=384, num_layers=2,
                       num_heads=4, num_kv_heads=2, head_dim=32, num_experts=8, num_experts_per_tok=2,
                       moe_intermediate_size=64),
}  # fmt: skip


# --- writing the checkpoint -------------------------------------------------------------------------------------------


def write_checkpoint(shapes: Shapes, folder: Path, dtype: torch.dtype, seed: int = 0, std: float = 0.02) -> int:
    """config.json, generation_config.json, a tokenizer and safetensors shards of random weights (normal with `std`;
    norms 1), each shard written and released before the next is made. Returns the weight bytes."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    dtype_name = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(shapes.hf_config(dtype_name), indent=2))
    (folder / "generation_config.json").write_text(json.dumps({"bos_token_id": 1, "eos_token_id": 2}))
    write_tokenizer(folder, shapes.vocab_size)
    generator = torch.Generator().manual_seed(seed)
    shard: dict[str, torch.Tensor] = {}
    shard_bytes = total = 0
    index: dict[str, str] = {}
    shards: list[str] = []

    def flush() -> None:
        nonlocal shard, shard_bytes
        name = f"model-{len(shards) + 1:05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        index.update(dict.fromkeys(shard, name))
        shards.append(name)
        shard, shard_bytes = {}, 0

    for name, shape in shapes.all_tensors():
        if len(shape) == 1:
            tensor = torch.ones(shape, dtype=dtype)
        else:
            tensor = (torch.randn(shape, generator=generator, dtype=torch.float32) * std).to(dtype)
        shard[name] = tensor
        shard_bytes += tensor.nbytes
        total += tensor.nbytes
        if shard_bytes >= SHARD_BYTES:
            flush()
    if shard:
        flush()
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": index})
    )
    return total


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer whose ids are the whole vocab ("w0" ... ): prompts here are token ids."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(folder))


# --- measuring ------------------------------------------------------------------------------------------------------


def memory_bandwidth(threads: int, gib: float = 1.0, repeats: int = 10, clock=time.perf_counter) -> float:
    """Bytes/s this host streams from memory: the best of `repeats` passes over a `gib` GiB float32 buffer, read as a
    sum and as a matrix-vector product (whichever streams faster), on `threads` threads (timed by `clock`)."""
    torch.set_num_threads(threads)
    side = int((gib * 1024**3 / 4) ** 0.5)
    buffer = torch.ones(side, side, dtype=torch.float32)
    vector = torch.ones(side, dtype=torch.float32)
    best = float("inf")
    for read in (buffer.sum, lambda: torch.mv(buffer, vector)):
        read()  # first touch, kernel selection
        for _ in range(repeats):
            start = clock()
            read()
            best = min(best, clock() - start)
    return buffer.nbytes / best


def _status_kib(field_name: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    return 0


def measure(
    folder: Path,
    dtype: str,
    threads: int,
    batches: list[int],
    prompt_len: int,
    output_len: int,
    quantization: str = "none",
) -> dict:
    """In this (fresh) process: start the engine on `folder` (weights in `quantization`), then decode at each batch
    size."""
    from batchserve import LLM, SamplingParams

    max_batch = max(batches)
    blocks_per_request = -(-(prompt_len + output_len) // 16) + 1
    model, tokenizer, quantization = engine_source(folder, quantization)
    start = time.perf_counter()
    llm = LLM(model=str(model), tokenizer=tokenizer, dtype=dtype, num_threads=threads, max_batch_size=max_batch,
              num_kv_blocks=max_batch * blocks_per_request, enable_prefix_caching=False,
              quantization=quantization)  # fmt: skip
    # VmHWM counts the checkpoint's memory-mapped pages too while a shard is read (clean file pages, reclaimable)
    result = {"load_s": time.perf_counter() - start, "rss_after_load_gib": _status_kib("VmRSS") / 1024**2,
              "anon_rss_after_load_gib": _status_kib("RssAnon") / 1024**2,
              "peak_rss_after_load_gib": _status_kib("VmHWM") / 1024**2, "decode": {}}  # fmt: skip
    vocab = llm.tokenizer.vocab_size
    generator = torch.Generator().manual_seed(1)
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    for batch in batches:
        prompts = [{"prompt_token_ids": torch.randint(3, vocab, (prompt_len,), generator=generator).tolist()}
                   for _ in range(batch)]  # fmt: skip
        sent = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        wall = time.perf_counter() - sent
        first = min(o.metrics.first_token_time for o in outputs)
        last = max(o.metrics.finished_time for o in outputs)
        tokens = sum(len(o.token_ids) - 1 for o in outputs)
        result["decode"][batch] = {"tok_s": tokens / (last - first), "step_ms": 1e3 * (last - first) / (output_len - 1),
                                   "e2e_tok_s": sum(len(o.token_ids) for o in outputs) / wall}  # fmt: skip
    result["peak_rss_gib"] = _status_kib("VmHWM") / 1024**2
    del llm  # its weights freed: room for the bandwidth buffer
    result["bandwidth"] = memory_bandwidth(threads)
    return result


def engine_source(folder: Path, quantization: str) -> tuple[Path, str | None, str]:
    """(model, tokenizer, quantization) for a --quantization entry: gguf:<type> is the GGUF file of that type beside the
    checkpoint, run as stored with the checkpoint's word-level tokenizer (not a conversion of the GGUF's token list)."""
    if quantization.startswith("gguf:"):
        return scale_gguf.gguf_path(folder, quantization.removeprefix("gguf:")), str(folder), "gguf"
    return folder, None, quantization


def gguf_types(quantizations: list[str]) -> list[str]:
    types = [q.removeprefix("gguf:") for q in quantizations if q.startswith("gguf:")]
    unknown = sorted(set(types) - set(scale_gguf.FILE_TYPES))
    if unknown:
        sys.exit(f"gguf:{unknown[0]}: the GGUF types written here are {', '.join(scale_gguf.FILE_TYPES)}")
    return types


def report_llama_cpp(args, summaries: dict, folder: Path, vocab_size: int) -> dict:
    """llama-bench's single-stream decode on each gguf:<type> file beside batchserve's batch-1 row on that file; then,
    at each larger batch size, llama-server's throughput beside batchserve's, both as generated tokens / wall time."""
    rows: dict = {}
    print(f"llama.cpp (llama-bench), batch 1, {args.threads} threads, {args.output_len} tokens after {args.prompt_len}")
    print(
        f"{'type':>5} {'file GiB':>9} {'llama.cpp tok/s':>20} {'batchserve tok/s':>17} {'batchserve / llama.cpp':>23}"
    )
    for type_name in gguf_types(args.quantization):
        path = scale_gguf.gguf_path(folder, type_name)
        row = scale_gguf.llama_bench(path, args.threads, args.output_len, args.prompt_len)
        ours = summaries[f"gguf:{type_name}"]["decode"].get("1", {}).get("tok_s")  # JSON keys: the child's
        rows[type_name] = {**row, "batchserve_tok_s": ours}
        theirs = f"{row['tok_s']:.2f} ± {row['sd_tok_s']:.2f}"
        ratio = f"{ours / row['tok_s']:.2f}x" if ours else "(no batch 1)"
        print(f"{type_name:>5} {row['file_gib']:>9.2f} {theirs:>20} {ours or float('nan'):>17.2f} {ratio:>23}")
    batches = [b for b in map(int, args.batches.split(",")) if b > 1] if args.llama_server else []
    for batch in batches:
        print(f"llama-server, {batch} requests at once, {args.threads} threads; generated tok/s over the wall time")
        for type_name in gguf_types(args.quantization):
            path = scale_gguf.gguf_path(folder, type_name)
            row = scale_gguf.llama_server_throughput(
                path, args.threads, batch, args.prompt_len, args.output_len, vocab_size
            )
            ours = summaries[f"gguf:{type_name}"]["decode"][str(batch)]["e2e_tok_s"]
            rows[f"{type_name} batch {batch}"] = {**row, "batchserve_tok_s": ours}
            print(f"{type_name:>5} -np {row['slots']:<3} {row['tok_s']:>9.2f}   batchserve {ours:>9.2f}   "
                  f"{ours / row['tok_s']:.2f}x")  # fmt: skip
    return rows


def report(
    shapes: Shapes,
    dtype: torch.dtype,
    weight_bytes: int,
    bandwidth: float,
    write_s: float,
    run: dict,
    quantization: str = "none",
) -> dict:
    element = torch.empty((), dtype=dtype).element_size()
    rows = {}
    for batch, decode in run["decode"].items():
        step_bytes = shapes.step_params(int(batch)) * element
        bound = int(batch) * bandwidth / step_bytes
        rows[batch] = {**decode, "bound_tok_s": bound, "share_of_bound": decode["tok_s"] / bound}
    summary = {"model": shapes.name, "dtype": str(dtype).removeprefix("torch."), "quantization": quantization,
               "weights_gib": weight_bytes / 1024**3, "write_s": write_s, "bandwidth_gb_s": bandwidth / 1e9, **run,
               "decode": rows}  # fmt: skip
    print(
        f"{shapes.name}, {summary['dtype']}, quantization {quantization}: {summary['weights_gib']:.2f} GiB of weights "
        f"(written in {write_s:.0f} s)"
    )
    print(f"load {run['load_s']:.1f} s; RSS after loading {run['rss_after_load_gib']:.2f} GiB (anonymous "
          f"{run['anon_rss_after_load_gib']:.2f}); peak RSS {run['peak_rss_after_load_gib']:.2f} GiB after loading, "
          f"{run['peak_rss_gib']:.2f} GiB after serving; memory bandwidth {bandwidth / 1e9:.1f} GB/s")  # fmt: skip
    print(f"{'batch':>5} {'decode tok/s':>13} {'step ms':>8} {'bound tok/s':>12} {'of bound':>9}"
          + ("  (the bound is the written dtype's)" if quantization != "none" else ""))  # fmt: skip
    for batch, row in rows.items():
        print(f"{batch:>5} {row['tok_s']:>13.2f} {row['step_ms']:>8.1f} {row['bound_tok_s']:>12.2f} "
              f"{100 * row['share_of_bound']:>8.0f}%")  # fmt: skip
    return summary


def measure_in_child(folder: Path, args, quantization: str) -> dict:
    child = [sys.executable, __file__, "--measure", str(folder), "--dtype", args.dtype, "--batches", args.batches,
             "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len),
             "--threads", str(args.threads), "--quantization", quantization]  # fmt: skip
    out = subprocess.run(child, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"the measuring process failed ({quantization}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny-llama")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--layers", type=int, default=None, help="override the preset's number of layers")
    parser.add_argument("--batches", default="1,32")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--dir", type=Path, default=None, help="where to write the checkpoint (kept)")
    parser.add_argument("--keep", action="store_true", help="keep the temporary checkpoint")
    parser.add_argument(
        "--quantization",
        nargs="+",
        default=["none"],
        help="weight formats, one run each: none, int8, int4..., gguf:Q8_0, gguf:Q4_0, gguf:Q4_1",
    )
    parser.add_argument("--llama-cpp", action="store_true", help="llama-bench on each gguf:<type> file (batch 1)")
    parser.add_argument("--llama-server", action="store_true", help="with --llama-cpp: llama-server at larger batches")
    parser.add_argument("--measure", type=Path, default=None, help=argparse.SUPPRESS)  # the child process
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.measure is not None:
        run = measure(
            args.measure, args.dtype, args.threads, batches, args.prompt_len, args.output_len, args.quantization[0]
        )
        print(json.dumps(run))
        return
    shapes, dtype = PRESETS[args.preset], getattr(torch, args.dtype)
    if args.layers is not None:
        shapes = dataclasses.replace(shapes, name=f"{shapes.name} (first {args.layers} layers)", num_layers=args.layers)
    types = gguf_types(args.quantization)
    if types and shapes.moe:
        sys.exit("gguf:<type>: only dense Llama checkpoints are written as GGUF here")
    if args.llama_server and not args.llama_cpp:
        sys.exit("--llama-server goes with --llama-cpp")
    if args.llama_cpp and not scale_gguf.llama_bench_binary().is_file():
        sys.exit(f"--llama-cpp: {scale_gguf.llama_bench_binary()} is missing (built as docs/quantization.md says)")
    folder = args.dir or Path(tempfile.mkdtemp(prefix=f"model_scale_{args.preset}_"))
    try:
        bandwidth = memory_bandwidth(args.threads)
        start = time.perf_counter()
        weight_bytes = write_checkpoint(shapes, folder, dtype)
        write_s = time.perf_counter() - start
        written = {f"gguf:{t}": p.stat().st_size for t, p in scale_gguf.write_ggufs(folder, types).items()}
        if written:
            print(f"GGUF files written in {time.perf_counter() - start - write_s:.0f} s")
        summaries = {}
        for quantization in args.quantization:
            run = measure_in_child(folder, args, quantization)
            bandwidth = max(bandwidth, run.pop("bandwidth"))  # measured every time: a busy host only lowers it
            summaries[quantization] = report(shapes, dtype, written.get(quantization, weight_bytes), bandwidth,
                                             write_s, run, quantization)  # fmt: skip
        if args.llama_cpp:
            summaries["llama.cpp"] = report_llama_cpp(args, summaries, folder, shapes.vocab_size)
        print(json.dumps(summaries))
    finally:
        if args.dir is None and not args.keep:
            shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
