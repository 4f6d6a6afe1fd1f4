"""Embeddings throughput (tokens/s) of the pooling runner against sentence-transformers on the same model folder and
host: a batch of --texts texts of exactly --tokens tokens each, embedded whole by each side, in alternating rounds
(one of each per round, the best of --rounds kept, so a busy spell of the shared host hits both alike). Wall time
and the process's CPU time are both reported: on a shared host the CPU time is the steadier measure of the work.

The model: random weights of SmolLM2-135M's shape (Llama, 576 wide, 9 heads of 64, 3 KV heads, SwiGLU 1536, tied
embeddings; --layers of its 30) saved with sentence-transformers' module files (last-token pooling, normalised: the
Qwen3-Embedding recipe), and the default model's tokenizer. Each text is --tokens words that are one token each, so
both sides compute the same tokens. Both sides run in --dtype; sentence-transformers with its default batch size 32
(--st-batch-size), batchserve with one engine step of up to --max-num-tokens tokens.

The bound printed last is the least time the work could take at torch's own GEMM rate on this host: the model's
matmuls (no lm_head: pooling reads hidden states) at M = one step's rows, plus the causal attention's FLOPs at that
same rate (roofline.py's timing; one thread's CPU seconds under --threads 1). Against it, the highest ratio to
sentence-transformers any engine could reach is its time over the bound.

    .venv/bin/python benchmarks/embeddings.py [--layers 30] [--texts 256] [--tokens 128] [--dtype bfloat16]
        [--rounds 2] [--threads N] [--prefill-attention auto|native|sdpa|split]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import transformers  # noqa: E402

from batchserve import LLM  # noqa: E402
from batchserve.layers.attention import preferred_prefill_method  # noqa: E402
from batchserve.models.loader import default_model_path, load_tokenizer  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import roofline  # noqa: E402

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                    num_key_value_heads=3, max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5,
                    tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)  # fmt: skip
MODULES = [
    {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
    {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
    {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
]


def build_folder(directory: Path, layers: int) -> transformers.PreTrainedTokenizerBase:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SMOLLM2_135M, num_hidden_layers=layers)
    transformers.LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer = load_tokenizer(default_model_path())
    tokenizer.pad_token = tokenizer.pad_token or tokenizer.eos_token
    tokenizer.save_pretrained(directory)
    (directory / "modules.json").write_text(json.dumps(MODULES))
    (directory / "1_Pooling").mkdir()
    (directory / "2_Normalize").mkdir()
    pooling = {"word_embedding_dimension": SMOLLM2_135M["hidden_size"], "pooling_mode_lasttoken": True,
               "pooling_mode_mean_tokens": False, "pooling_mode_cls_token": False, "include_prompt": True}  # fmt: skip
    (directory / "1_Pooling" / "config.json").write_text(json.dumps(pooling))
    return tokenizer


def texts_of(tokenizer, count: int, length: int) -> list[str]:
    """Texts of exactly `length` tokens: words that the tokenizer keeps as one token after a space."""
    words = [t[1:] for t in tokenizer.get_vocab() if t.startswith("Ġ") and t[1:].isalpha() and len(t) > 3]
    words = [w for w in sorted(words) if len(tokenizer(" " + w, add_special_tokens=False)["input_ids"]) == 1]
    rng = random.Random(0)
    texts = [" " + " ".join(rng.choice(words) for _ in range(length)) for _ in range(count)]
    lengths = {len(tokenizer(t)["input_ids"]) for t in texts}
    assert lengths == {length}, f"texts of {lengths} tokens"
    return texts


def flop_bound_s(args: argparse.Namespace) -> tuple[float, float]:
    """(bound seconds, its GFLOP/s): the matmuls at M = a step's rows and the causal attention at that rate."""
    rows = min(args.max_num_tokens, args.texts * args.tokens)
    dtype = getattr(torch, args.dtype)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    step_s = sum(roofline.time_matmuls(rows, shape, args.layers, dtype, 0.5, clock)
                 for shape in roofline.LAYER_SHAPES.values())  # fmt: skip
    matmul_flops = 2 * rows * sum(k * n for k, n in roofline.LAYER_SHAPES.values())
    rate = matmul_flops / step_s  # FLOP/s of one layer's projections at that M
    width = roofline.HEADS * roofline.HEAD_DIM
    attention_flops = 4 * width * args.tokens * (args.tokens + 1) / 2 * args.texts  # QK^T and PV, lower triangle
    total_flops = args.layers * (matmul_flops * args.texts * args.tokens / rows + attention_flops)
    return total_flops / rate, rate / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--texts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--st-batch-size", type=int, default=32)
    parser.add_argument("--max-num-tokens", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--prefill-attention", default="auto", choices=["auto", "native", "sdpa", "split"],
                        help="batchserve's prefill_attention option (auto: split for bfloat16 on a CPU with AMX, "
                             "else native); BATCHSERVE_PREFILL_ATTENTION, where set, overrides it")  # fmt: skip
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    from sentence_transformers import SentenceTransformer

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        tokenizer = build_folder(folder, args.layers)
        texts = texts_of(tokenizer, args.texts, args.tokens)
        dtype = getattr(torch, args.dtype)
        total_blocks = args.texts * (args.tokens // 16 + 1) + 16
        llm = LLM(str(folder), dtype=args.dtype, device="cpu", num_kv_blocks=total_blocks,
                  max_num_tokens=args.max_num_tokens, max_batch_size=args.texts, num_threads=args.threads,
                  prefill_attention=args.prefill_attention)  # fmt: skip
        reference = SentenceTransformer(str(folder), device="cpu", model_kwargs={"dtype": dtype})
        ours = lambda: llm.embed(texts)  # noqa: E731
        theirs = lambda: reference.encode(texts, batch_size=args.st_batch_size, convert_to_tensor=True)  # noqa: E731
        llm.embed(texts[:4]), reference.encode(texts[:4])  # warm-up: kernels, allocator
        best = {"batchserve": float("inf"), "sentence-transformers": float("inf")}
        cpu = dict(best)
        for _ in range(args.rounds):
            for name, run in (("batchserve", ours), ("sentence-transformers", theirs)):
                start, start_cpu = time.perf_counter(), time.process_time()
                out = run()
                best[name] = min(best[name], time.perf_counter() - start)
                cpu[name] = min(cpu[name], time.process_time() - start_cpu)
                if name == "batchserve":
                    got = torch.tensor([o.embedding for o in out])
                else:
                    want = out.float()
        agreement = float(torch.nn.functional.cosine_similarity(got, want, dim=1).min())
    tokens = args.texts * args.tokens
    ran = preferred_prefill_method(getattr(torch, args.dtype), args.prefill_attention)  # the engine's, cached
    print(f"model: SmolLM2-135M shape, {args.layers} layers, random weights, {args.dtype}; {args.texts} texts x "
          f"{args.tokens} tokens; torch threads {torch.get_num_threads()}; batchserve prefill attention "
          f"{args.prefill_attention} (ran: {ran})")  # fmt: skip
    for name, seconds in best.items():
        print(f"{name:>22}: {seconds:7.2f} s wall  {tokens / seconds:8.0f} tokens/s;  {cpu[name]:7.2f} CPU-s  "
              f"{tokens / cpu[name]:8.0f} tokens per CPU-second")  # fmt: skip
    ratio_clock = cpu if args.threads == 1 else best
    bound_s, gflops = flop_bound_s(args)
    print(f"bound: {bound_s:.2f} s ({tokens / bound_s:.0f} tokens/s) at torch's GEMM rate {gflops:.0f} GFLOP/s at "
          f"M = {min(args.max_num_tokens, tokens)} ({'CPU' if args.threads == 1 else 'wall'} clock); batchserve at "
          f"{bound_s / ratio_clock['batchserve']:.2f} of it, sentence-transformers at "
          f"{bound_s / ratio_clock['sentence-transformers']:.2f}; the most any engine could reach against "
          f"sentence-transformers here: {ratio_clock['sentence-transformers'] / bound_s:.2f}x")  # fmt: skip
    print(
        f"ratio batchserve / sentence-transformers: {best['sentence-transformers'] / best['batchserve']:.2f}x wall, "
        f"{cpu['sentence-transformers'] / cpu['batchserve']:.2f}x CPU; lowest cosine between the two sides' "
        f"embeddings {agreement:.5f}"
    )


if __name__ == "__main__":
    main()
