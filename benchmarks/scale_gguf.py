"""A Llama checkpoint written by benchmarks/model_scale.py, as GGUF files llama.cpp runs, and llama-bench on them.

    .venv/bin/python benchmarks/scale_gguf.py CHECKPOINT_DIR --types Q8_0 Q4_0 [--llama-bench --threads 1]

Each file is laid out as llama.cpp's converter (convert_hf_to_gguf.py) and then its quantizer (`llama-quantize
--pure`) would: the `llama` architecture's metadata, q/k rows permuted into llama.cpp's RoPE order, Llama 3's rope
scaling as the rope_freqs tensor, norms in F32 and every matrix (the embedding table and the output projection
included) in the one type. The weights are the checkpoint's own (read from its safetensors, one tensor at a time and
quantized in row chunks, so the writer holds one tensor's codes); the vocabulary is the checkpoint's word-level one
("w0" ...) as a SentencePiece-style `llama` token list, enough for llama.cpp to load and run token ids (batchserve reads
the GGUF with `tokenizer=CHECKPOINT_DIR`, the folder's own tokenizer).

--llama-bench times llama.cpp's single-stream decode on each file: `llama-bench -p 0 -n N -d DEPTH` (N tokens generated
after DEPTH tokens of context), from the build benchmarks/peer_compare.py uses (<cache dir>/peers/llama.cpp-build).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from batchserve import env  # noqa: E402

# the types gguf-py quantizes that batchserve's quantization gguf runs as stored, with llama.cpp's file type for each
FILE_TYPES = {
    "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    "Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
    "Q4_1": gguf.LlamaFileType.MOSTLY_Q4_1,
}
CHUNK_ELEMENTS = 1 << 24  # rows quantized at a time: a chunk's float32 copy and gguf-py's temporaries stay small
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}  # fmt: skip
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}  # fmt: skip


def gguf_path(checkpoint: Path, type_name: str) -> Path:
    """Where the GGUF of a checkpoint in `type_name` is written: inside the checkpoint's folder."""
    return checkpoint / f"model.{type_name}.gguf"


def gguf_name(hf_name: str) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, index, rest = hf_name.split(".", 3)  # model.layers.<i>.<module>.weight
    module = rest.removesuffix(".weight")
    if hf_name.split(".")[:2] != ["model", "layers"] or module not in LAYER_NAMES:
        raise ValueError(f"{hf_name}: not a tensor of a dense Llama checkpoint")
    return f"blk.{index}.{LAYER_NAMES[module]}.weight"


def llama_cpp_permute(weights: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from HF's rotate-half order to llama.cpp's pairs
    (batchserve's models/gguf_weights.unpermute_qk is its inverse)."""
    return (
        weights.reshape(heads, 2, weights.shape[0] // heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama3_rope_factors(config: dict) -> np.ndarray | None:
    """convert_hf_to_gguf.py's rope_freqs tensor for rope_type llama3 (one divisor per frequency), else None."""
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return None
    dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    base = config.get("rope_theta", 10000.0)
    factor, low, high = (
        scaling.get("factor", 8.0),
        scaling.get("low_freq_factor", 1.0),
        scaling.get("high_freq_factor", 4.0),
    )
    old_context = scaling.get("original_max_position_embeddings", 8192)
    factors = []
    for freq in 1.0 / (base ** (np.arange(0, dim, 2, dtype=np.float32) / dim)):
        wavelen = 2 * math.pi / freq
        if wavelen < old_context / high:
            factors.append(1.0)
        elif wavelen > old_context / low:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


# --- writing ----------------------------------------------------------------------------------------------------------


@dataclass
class Checkpoint:
    """A model_scale.py folder: its config.json and its tensors, each read alone from the memory-mapped shards."""

    folder: Path

    @property
    def config(self) -> dict:
        config = json.loads((self.folder / "config.json").read_text())
        if config.get("model_type") != "llama":
            raise ValueError(f"{self.folder}: model_type {config.get('model_type')!r}; only dense Llama is written")
        return config

    def shapes(self) -> list[tuple[str, tuple[int, ...]]]:
        from safetensors import safe_open

        found = []
        for file in sorted(self.folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                found += [(name, tuple(f.get_slice(name).get_shape())) for name in f.keys()]
        return found

    def tensors(self) -> Iterator[tuple[str, tuple[int, ...], Callable[[int, int], np.ndarray]]]:
        """(name, shape, rows) for each tensor in shapes()'s order: rows(start, stop) reads those rows alone, as
        float32."""
        from safetensors import safe_open

        for file in sorted(self.folder.glob("*.safetensors")):
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    tensor = f.get_slice(name)
                    yield name, tuple(tensor.get_shape()), lambda start, stop, t=tensor: t[start:stop].float().numpy()


def write_gguf(checkpoint: Path, path: Path, type_name: str) -> int:
    """The checkpoint as a GGUF file in `type_name` (see the module docstring); returns the file's bytes."""
    source = Checkpoint(checkpoint)
    config, qtype = source.config, gguf.GGMLQuantizationType[type_name]
    writer = gguf.GGUFWriter(str(path), "llama")
    add_metadata(writer, config, type_name)
    rope_factors = llama3_rope_factors(config)
    for name, shape in source.shapes():
        kind = qtype if len(shape) == 2 else gguf.GGMLQuantizationType.F32
        writer.add_tensor_info(
            gguf_name(name), shape, np.dtype(np.float32), quantized_bytes(shape, kind), raw_dtype=kind
        )
    if rope_factors is not None:
        writer.add_tensor_info("rope_freqs.weight", rope_factors.shape, rope_factors.dtype, rope_factors.nbytes)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    for name, shape, rows in source.tensors():
        projection = name.split(".")[-2]
        if len(shape) == 1:
            writer.write_tensor_data(rows(0, shape[0]))
        elif projection in heads:  # the permutation mixes a head's rows: the whole matrix (q: hidden x hidden)
            writer.write_tensor_data(quantize_rows(llama_cpp_permute(rows(0, shape[0]), heads[projection]), qtype))
        else:
            writer.write_tensor_data(quantize_rows(rows, qtype, shape))
    if rope_factors is not None:
        writer.write_tensor_data(rope_factors)
    writer.close()
    return path.stat().st_size


def quantized_bytes(shape: tuple[int, ...], qtype: gguf.GGMLQuantizationType) -> int:
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * size


def quantize_rows(
    weights: np.ndarray | Callable[[int, int], np.ndarray], qtype: gguf.GGMLQuantizationType, shape=None
) -> np.ndarray:
    """gguf.quants.quantize over chunks of rows (blocks never cross a row: the codes of one call), each read when it is
    quantized when `weights` is a reader rows(start, stop) of a matrix of `shape`."""
    if isinstance(weights, np.ndarray):
        matrix, shape = weights, weights.shape
        weights = lambda start, stop: matrix[start:stop]  # noqa: E731
    rows, cols = shape
    out = np.empty((rows, quantized_bytes((1, cols), qtype)), dtype=np.uint8)
    step = max(1, CHUNK_ELEMENTS // cols)
    for start in range(0, rows, step):
        out[start : start + step] = gguf.quants.quantize(weights(start, min(rows, start + step)), qtype)
    return out


def add_metadata(writer: gguf.GGUFWriter, config: dict, type_name: str) -> None:
    """What llama.cpp's `llama` loader reads (convert_hf_to_gguf.py's keys), and a token list of the vocab's size."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_name(f"random Llama ({config['num_hidden_layers']} layers, hidden {config['hidden_size']})")
    writer.add_vocab_size(config["vocab_size"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(FILE_TYPES[type_name])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_vocabulary(writer, config)


def add_vocabulary(writer: gguf.GGUFWriter, config: dict) -> None:
    """The word-level vocabulary's tokens ("w<i>") as a `llama` (SentencePiece) list: bos / eos as control tokens,
    id 0 (the word-level tokenizer's unknown) as the unknown token."""
    vocab, bos, eos = config["vocab_size"], config["bos_token_id"], config["eos_token_id"]
    types = np.full(vocab, gguf.TokenType.NORMAL, dtype=np.int32)
    types[[bos, eos]] = gguf.TokenType.CONTROL
    types[0] = gguf.TokenType.UNKNOWN
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([f"w{i}" for i in range(vocab)])
    writer.add_token_scores([0.0] * vocab)
    writer.add_token_types(types.tolist())
    writer.add_bos_token_id(bos)
    writer.add_eos_token_id(eos)
    writer.add_unk_token_id(0)
    writer.add_add_bos_token(False)  # prompts here are token ids


def write_ggufs(checkpoint: Path, type_names: list[str]) -> dict[str, Path]:
    written = {}
    for type_name in type_names:
        path = gguf_path(checkpoint, type_name)
        size = write_gguf(checkpoint, path, type_name)
        print(f"wrote {path.name}: {size / 1024**3:.2f} GiB", file=sys.stderr)
        written[type_name] = path
    return written


# --- llama-bench ------------------------------------------------------------------------------------------------------


def llama_bench_binary() -> Path:
    return env.cache_dir() / "peers" / "llama.cpp-build" / "bin" / "llama-bench"


def llama_bench(path: Path, threads: int, tokens: int = 16, depth: int = 32, repeats: int = 3) -> dict:
    """llama.cpp's single-stream decode on `path`: tok/s (mean and sd over `repeats`) generating `tokens` tokens after
    `depth` tokens of context, and the build it ran."""
    binary = llama_bench_binary()
    if not binary.is_file():
        raise FileNotFoundError(f"{binary} is missing: build llama-bench as docs/quantization.md describes")
    command = [str(binary), "-m", str(path), "-p", "0", "-n", str(tokens), "-d", str(depth), "-t", str(threads),
               "-r", str(repeats), "-o", "json"]  # fmt: skip
    out = subprocess.run(command, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"llama-bench failed on {path.name}:\n{out.stderr[-4000:]}")
    (test,) = [t for t in json.loads(out.stdout) if t["n_gen"] > 0]
    return {"tok_s": test["avg_ts"], "sd_tok_s": test["stddev_ts"], "tokens": tokens, "depth": depth,
            "threads": threads, "build": test.get("build_commit"), "file_gib": path.stat().st_size / 1024**3}  # fmt: skip


def llama_server_throughput(
    path: Path, threads: int, batch: int, prompt_len: int, output_len: int, vocab_size: int, slots: int = 32
) -> dict:
    """`llama-server -np min(batch, slots)` on `path` (benchmarks/llama_server_peer.py, the same build as llama-bench):
    `batch` requests of `prompt_len` random token ids sent at once, greedy, `output_len` tokens each; tok/s = the
    generated tokens / the time from sending them to the last answer (prefill included)."""
    import llama_server_peer

    binary = llama_bench_binary().with_name("llama-server")
    if not binary.is_file():
        raise FileNotFoundError(f"{binary} is missing: build llama-server as docs/quantization.md describes")
    rng = np.random.default_rng(1)
    requests = [{"prompt_token_ids": rng.integers(3, vocab_size, prompt_len).tolist(), "max_tokens": output_len}
                for _ in range(batch)]  # fmt: skip
    run = llama_server_peer.run(binary, path, requests, min(batch, slots), threads, timeout=1800, extra=[])
    tokens = sum(len(tokens) for tokens in run["outputs"])
    return {"tok_s": tokens / run["wall_s"], "slots": run["slots"], "batch": batch, "threads": threads}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", type=Path, help="a folder benchmarks/model_scale.py wrote (--dir / --keep)")
    parser.add_argument("--types", nargs="+", choices=sorted(FILE_TYPES), default=["Q8_0", "Q4_0"])
    parser.add_argument("--llama-bench", action="store_true", help="then time llama.cpp's decode on each file")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    for type_name, path in write_ggufs(args.checkpoint, args.types).items():
        if args.llama_bench:
            row = llama_bench(path, args.threads, args.tokens, repeats=args.repeats)
            print(json.dumps({"type": type_name, **row}))


if __name__ == "__main__":
    main()
