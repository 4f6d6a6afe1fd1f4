"""Accuracy of the weight formats: over a fixed text shipped beside this script (benchmarks/quant_text.txt),
each format's next-token distribution against float32's: mean KL(float32 || format), top-1 agreement, and the text's
perplexity under each. The model is the default one (SmolLM2-135M-Instruct's GGUF, dequantized at load to float32:
the reference) or --model; windows of --window tokens, each its own prefill (the same windows for every format).
--dtype bfloat16 runs the formats (and the unquantized model) in bf16 against the same float32 reference: a bf16
model's quantized GEMM of a window (every row count from 24) is the AMX path's where the bf16 GEMM path is amx or
amx_emulated (BATCHSERVE_GEMM_PATH), W8A8 elsewhere.

    .venv/bin/python benchmarks/quant_accuracy.py [--formats none int8 int4 int4_g64] [--kv float32 int8]
        [--tokens 2048] [--json out] [--llama-cpp [--llama-cpp-q8 PATH] [--threads 2]]

--llama-cpp adds llama.cpp's rows (llama-cpp-python, all logits kept) over the same token ids and windows: the model's
own GGUF file (a GGUF --model only), and with --llama-cpp-q8 a Q8_0 file made from it by llama.cpp's quantizer
(requantized; written once to that path), both against the same float32 reference.

--kv: the KV pool of each format's runs, float32 (the default), int8 and/or fp8_e4m3 (kv_cache_dtype: every window
attends to its K/V as the quantized pool stores them, as decode would); a pool other than float32 adds the rows of that
pool with every format, none included (the KV pool's own distance from the reference). The reference is always
float32 weights over a float32 pool. On the native kernels' default path the weight formats run W8A8
(quant_w8a8.cpp) at every M.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # llama_cpp_peer beside this script

from batchserve.core.outputs import NewRequestData, SchedulerOutput  # noqa: E402
from batchserve.layers import kernels, kv_quant  # noqa: E402
from batchserve.layers.quantization import quantized_linears  # noqa: E402
from batchserve.models.loader import load_model, load_model_config, load_tokenizer, resolve_model_path  # noqa: E402
from batchserve.sampling_params import SamplingParams  # noqa: E402
from batchserve.worker.input_batch import RequestTable  # noqa: E402

TEXT = Path(__file__).resolve().parent / "quant_text.txt"
KV_CODES = {"int8": torch.int8, "fp8_e4m3": torch.float8_e4m3fn}
BLOCK = 16


def window_logits(model, config, tokens: list[int], kv_dtype: str = "float32", dtype=torch.float32) -> torch.Tensor:
    """log-softmax [T, V] of one window's prefill, through the real input batch and paged attention, over a KV pool
    of kv_dtype (float32: the model's dtype; int8 or fp8_e4m3)."""
    blocks = -(-len(tokens) // BLOCK) + 1
    shape = (blocks, BLOCK, config.num_kv_heads, config.head_dim)
    if kv_dtype in KV_CODES:
        cpu, code = torch.device("cpu"), KV_CODES[kv_dtype]
        kv = [kv_quant.QuantizedKV.zeros(shape, cpu, dtype=code) for _ in range(config.num_layers)]
    else:
        kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(config.num_layers)]
    out = SchedulerOutput(
        new_requests=[
            NewRequestData("r", tokens, len(tokens), SamplingParams(temperature=0.0), list(range(blocks)), 0)
        ],
        num_scheduled_tokens={"r": len(tokens)},
    )
    table = RequestTable(BLOCK)
    table.apply(out)
    batch = table.build(out, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(batch.input_ids, batch.positions, kv, batch.attn_metadata)
        return torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)


def text_log_probs(
    path: Path, config, fmt: str, windows: list[list[int]], kv_dtypes=("float32",), dtype=torch.float32
) -> dict:
    """{kv dtype: log-probs [tokens, V]} of the model in weight format fmt and `dtype`, over a pool of each kv dtype."""
    cpu = torch.device("cpu")
    with quantized_linears(fmt, dtype):
        model = load_model(path, config, dtype, cpu)
    return {kv: torch.cat([window_logits(model, config, w, kv, dtype) for w in windows]) for kv in kv_dtypes}


def compare(reference: torch.Tensor, other: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """KL(reference || other) per position, averaged; top-1 agreement; perplexity of the targets under `other`."""
    kl = (reference.exp() * (reference - other)).sum(-1)
    return {
        "mean_kl": kl.mean().item(),
        "max_kl": kl.max().item(),
        "top1_agreement": (reference.argmax(-1) == other.argmax(-1)).float().mean().item(),
        "perplexity": other.gather(-1, targets[:, None]).neg().mean().exp().item(),
    }


def llama_cpp_rows(path: Path, args, inputs, reference, targets) -> list[dict]:
    import llama_cpp_peer

    print(llama_cpp_peer.describe())
    files = [("llama.cpp " + path.stem.rsplit(".", 1)[-1] + " (file)", path)]
    if args.llama_cpp_q8:
        files.append(("llama.cpp Q8_0", llama_cpp_peer.quantize_q8_0(path, args.llama_cpp_q8)))
    rows = []
    for name, gguf in files:
        for kv in args.llama_cpp_kv:
            other = llama_cpp_peer.window_log_probs(gguf, inputs, args.threads, kv)
            rows.append({"format": f"{name}, KV {kv}", **compare(reference, other, targets)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="HF directory or .gguf (default: the default SmolLM2)")
    parser.add_argument("--formats", nargs="+", default=["int8", "int4", "int4_g64"])
    parser.add_argument("--tokens", type=int, default=2048, help="tokens of the text scored (at most the text's)")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--kv", nargs="+", default=["float32"], choices=["float32", *KV_CODES], help="KV pools")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--llama-cpp", action="store_true", help="add llama.cpp's rows (needs the `peers` extra)")
    parser.add_argument("--llama-cpp-q8", type=Path, default=None, help="also a Q8_0 GGUF written here by llama.cpp")
    parser.add_argument("--llama-cpp-kv", nargs="+", default=["f16"], choices=["f16", "f32", "q8_0"])
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads")
    parser.add_argument(
        "--dtype", choices=["float32", "bfloat16"], default="float32", help="the formats' model dtype (a bfloat16 "
        "row 'none' added; the reference stays float32)"
    )  # fmt: skip
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    path = resolve_model_path(args.model)
    config = load_model_config(path)
    ids = load_tokenizer(path, None).encode(TEXT.read_text())[: args.tokens + 1]
    windows = [ids[i : i + args.window + 1] for i in range(0, len(ids) - 1, args.window)]
    targets = torch.tensor([t for w in windows for t in w[1:]])
    inputs = [w[:-1] for w in windows]
    started = time.perf_counter()
    other_kv = [kv for kv in args.kv if kv != "float32"]
    runs = text_log_probs(path, config, "none", inputs, ("float32", *other_kv))
    reference = runs["float32"]
    rows = [{"format": "none (float32)", **compare(reference, reference, targets)}]
    rows += [{"format": f"none, KV {kv}", **compare(reference, runs[kv], targets)} for kv in other_kv]
    formats = args.formats if dtype == torch.float32 else ["none", *args.formats]
    for fmt in formats:
        for kv, log_probs in text_log_probs(path, config, fmt, inputs, args.kv, dtype).items():
            name = (fmt if dtype == torch.float32 else f"{fmt} ({args.dtype})") + (
                "" if kv == "float32" else f", KV {kv}"
            )
            rows.append({"format": name, **compare(reference, log_probs, targets)})
    if args.llama_cpp:
        rows.extend(llama_cpp_rows(path, args, inputs, reference, targets))
    print(f"model {path.name}, {len(targets)} tokens of {TEXT.name}, windows of {args.window}, "
          f"{time.perf_counter() - started:.0f} s; CPU flags avx512_bf16: {'avx512_bf16' in kernels.cpu_flags()}")  # fmt: skip
    print(f"{'format':<32}{'mean KL':>12}{'max KL':>10}{'top-1':>8}{'ppl':>9}")
    for r in rows:
        print(f"{r['format']:<32}{r['mean_kl']:>12.5f}{r['max_kl']:>10.3f}{r['top1_agreement']:>8.3f}{r['perplexity']:>9.3f}")  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"model": path.name, "tokens": len(targets), "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
