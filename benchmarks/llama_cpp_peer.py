"""llama.cpp as a benchmark peer, through llama-cpp-python: never a dependency of batchserve itself.

Install with `.venv/bin/pip install -e '.[peers]'` (builds llama.cpp from the sdist with CMake, CPU only); see
docs/quantization.md. Everything here feeds llama.cpp token ids, never text, so batchserve and llama.cpp see the same
tokens whatever their tokenizers would do.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

INSTALL_HINT = "llama-cpp-python is not installed: `.venv/bin/pip install -e '.[peers]'` (see docs/quantization.md)"


def llama_cpp_module():
    try:
        import llama_cpp
    except ImportError as exc:
        raise SystemExit(INSTALL_HINT) from exc
    return llama_cpp


def describe() -> str:
    """llama-cpp-python's version and the CPU features its llama.cpp build uses."""
    llama_cpp = llama_cpp_module()
    info = llama_cpp.llama_print_system_info().decode().strip()
    return f"llama-cpp-python {llama_cpp.__version__}; {info}"


@dataclass
class LlamaCppOptions:
    threads: int
    n_ctx: int = 1024
    n_batch: int = 512
    logits_all: bool = False
    kv_type: str = "f16"  # llama.cpp's default KV cache type


def load(path: Path, options: LlamaCppOptions):
    llama_cpp = llama_cpp_module()
    ggml_types = {"f16": llama_cpp.GGML_TYPE_F16, "f32": llama_cpp.GGML_TYPE_F32, "q8_0": llama_cpp.GGML_TYPE_Q8_0}
    return llama_cpp.Llama(
        model_path=str(path),
        n_ctx=options.n_ctx,
        n_batch=options.n_batch,
        n_ubatch=options.n_batch,
        n_threads=options.threads,
        n_threads_batch=options.threads,
        logits_all=options.logits_all,
        type_k=ggml_types[options.kv_type],
        type_v=ggml_types[options.kv_type],
        flash_attn=options.kv_type == "q8_0",  # llama.cpp quantizes its V cache only under flash attention
        verbose=False,
    )


def window_log_probs(path: Path, windows: list[list[int]], threads: int, kv_type: str = "f16"):
    """log-softmax [T, V] (float32 torch tensor) of each window evaluated from an empty cache, all logits kept."""
    import torch

    longest = max(len(w) for w in windows)
    llm = load(path, LlamaCppOptions(threads=threads, n_ctx=longest + 16, n_batch=longest, logits_all=True,
                                     kv_type=kv_type))  # fmt: skip
    rows = []
    for window in windows:
        llm.reset()
        llm.eval(window)
        logits = torch.from_numpy(np.array(llm.scores[: len(window)], dtype=np.float32))
        rows.append(torch.log_softmax(logits, dim=-1))
    llm.close()
    return torch.cat(rows)


def quantize_q8_0(source: Path, target: Path, threads: int = 2) -> Path:
    """A Q8_0 GGUF of `source` written by llama.cpp's own quantizer (requantizing a quantized file); kept once made."""
    import ctypes

    llama_cpp = llama_cpp_module()
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0
    params.allow_requantize = True
    params.nthread = threads
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(target).encode(), ctypes.byref(params))
    if status != 0:
        target.unlink(missing_ok=True)
        raise RuntimeError(f"llama.cpp could not quantize {source} to Q8_0 (status {status})")
    return target


class GreedyDecoder:
    """Batch-1 greedy decode in llama.cpp: the prompt's ids evaluated, then one token at a time, each the argmax of
    the last logits (read in place, no copy of the whole score table)."""

    def __init__(self, path: Path, threads: int, n_ctx: int = 512):
        self.llama_cpp = llama_cpp_module()
        self.llm = load(path, LlamaCppOptions(threads=threads, n_ctx=n_ctx))
        self.n_vocab = self.llm.n_vocab()

    def _next_token(self) -> int:
        pointer = self.llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))))

    def generate(self, prompt_ids: list[int], tokens: int) -> list[int]:
        self.llm.reset()
        self.llm.eval(prompt_ids)
        out = [self._next_token()]
        while len(out) < tokens:
            self.llm.eval([out[-1]])
            out.append(self._next_token())
        return out

    def timed(self, prompt_ids: list[int], tokens: int) -> float:
        start = time.perf_counter()
        self.generate(prompt_ids, tokens)
        return time.perf_counter() - start

    def close(self) -> None:
        self.llm.close()
