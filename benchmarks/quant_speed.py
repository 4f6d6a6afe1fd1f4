"""Single-stream decode speed of the weight formats, indicative: batch 1 greedy on the default model (or
--model), decode tokens per second as (tokens - 1) / (time of a --tokens generation - time of a 1-token one), best of
--repeats, each format in its own engine, all engines loaded first and then measured in alternating rounds (one
measurement of each per round) in one process, so a busy spell of the shared host hits them alike; best and median.

    .venv/bin/python benchmarks/quant_speed.py [--formats none int8 int4] [--dtype auto] [--tokens 64] [--threads 1]
        [--llama-cpp [--llama-cpp-also PATH ...]]

--llama-cpp adds llama.cpp (llama-cpp-python, the `peers` extra) on the same GGUF file as a row measured the same way
in the same rounds: the same prompt token ids, greedy argmax of the last logits each step, --threads threads (default:
torch's thread count), its default f16 KV cache. --llama-cpp-also adds llama.cpp on other GGUF files of the same model
(a Q8_0 file for int8's like-for-like: benchmarks/quant_accuracy.py --llama-cpp-q8 writes one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # llama_cpp_peer beside this script

from batchserve import LLM, SamplingParams  # noqa: E402
from batchserve.layers import kernels  # noqa: E402
from batchserve.models.loader import load_tokenizer, resolve_model_path  # noqa: E402

PROMPT = "Explain how a paged KV cache lets a server batch many requests at once."
SETTLE_S = 0.2  # lets the other runtime's OpenMP threads stop spinning before the next measurement


class BatchserveDecoder:
    def __init__(self, fmt: str, args):
        self.llm = LLM(
            model=args.model,
            dtype=args.dtype,
            device="cpu",
            quantization=fmt,
            num_kv_blocks=64,
            max_batch_size=1,
            num_threads=args.threads,
        )

    def timed(self, prompt_ids: list[int], tokens: int) -> float:
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        start = time.perf_counter()
        self.llm.generate([{"prompt_token_ids": prompt_ids}], params, use_tqdm=False)
        return time.perf_counter() - start


def decode_rate(engine, prompt_ids: list[int], tokens: int) -> float:
    time.sleep(SETTLE_S)
    return (tokens - 1) / (engine.timed(prompt_ids, tokens) - engine.timed(prompt_ids, 1))


def engines(args) -> dict[str, object]:
    built = {f"{fmt} ({args.dtype})" if fmt == "none" else fmt: BatchserveDecoder(fmt, args) for fmt in args.formats}
    if args.llama_cpp:
        import llama_cpp_peer
        import torch

        print(llama_cpp_peer.describe())
        threads = args.threads or torch.get_num_threads()
        for path in [resolve_model_path(args.model), *map(Path, args.llama_cpp_also)]:
            built[f"llama.cpp {path.stem.rsplit('.', 1)[-1]}"] = llama_cpp_peer.GreedyDecoder(path, threads)
    return built


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--formats", nargs="+", default=["none", "int8", "int4"])
    parser.add_argument("--dtype", default="auto", help="activations (and the weights of format none)")
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (1: steadier on a busy host)")
    parser.add_argument("--llama-cpp", action="store_true", help="add llama.cpp on the same file (`peers` extra)")
    parser.add_argument("--llama-cpp-also", nargs="*", default=[], help="with --llama-cpp: more GGUF files")
    args = parser.parse_args()
    flags = kernels.cpu_flags().split()
    print(f"bf16 matmul units: {'yes' if 'avx512_bf16' in flags or 'amx_bf16' in flags else 'no'}; "
          f"int8 dot products (avx512_vnni): {'yes' if 'avx512_vnni' in flags else 'no'}")  # fmt: skip
    prompt_ids = load_tokenizer(resolve_model_path(args.model), None).encode(PROMPT)
    built = engines(args)
    for engine in built.values():
        engine.timed(prompt_ids, 4)  # warm-up
    rates: dict[str, list[float]] = {name: [] for name in built}
    for _ in range(args.repeats):
        for name, engine in built.items():
            rates[name].append(decode_rate(engine, prompt_ids, args.tokens))
    print(f"batch 1, {args.tokens} tokens, {len(prompt_ids)} prompt tokens, threads {args.threads or 'default'}, "
          f"{args.repeats} alternating rounds; decode tok/s")  # fmt: skip
    print(f"{'engine':<18}{'best':>8}{'median':>8}")
    for name, values in rates.items():
        print(f"{name:<18}{max(values):>8.1f}{statistics.median(values):>8.1f}", flush=True)


if __name__ == "__main__":
    main()
