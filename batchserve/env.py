"""Every environment variable batchserve reads, with its default: read when called, nothing cached here.

It imports nothing from batchserve, so that any layer may take its settings from it.
"""

from __future__ import annotations

import os
from pathlib import Path

# benchmarks/ keeps what it downloads and builds here (the folder is git-ignored): a source checkout's bench_results/
BENCH_RESULTS = Path(__file__).resolve().parent.parent / "bench_results"


def native_kernels() -> bool:
    """BATCHSERVE_NATIVE_KERNELS (default "1"): "0" turns the native CPU kernels off; the torch code runs instead."""
    return os.environ.get("BATCHSERVE_NATIVE_KERNELS", "1") != "0"


def low_precision_units() -> bool | None:
    """BATCHSERVE_LOW_PRECISION_UNITS (default unset: read the CPU's flags): "1" or "0" forces the answer to "does this
    CPU multiply bf16/fp16 natively?", and with it the GEMM path of bfloat16 models and what dtype "auto" picks; to
    measure or test one path on any CPU."""
    value = os.environ.get("BATCHSERVE_LOW_PRECISION_UNITS")
    return None if value in (None, "") else value != "0"


def attention_path() -> str | None:
    """BATCHSERVE_ATTENTION_PATH (default unset or "auto": the CPU's flags decide): forces the native attention
    kernels' path, "avx512_bf16" (bf16 K/V multiplied as they are, by AVX512-BF16), "avx512" (K/V widened to float32),
    "avx2" (8-wide AVX2 + FMA decode, the torch code for prefill) or "portable" (the plain C++ loop for decode, the
    torch code for prefill); to measure or test one path. A path this build or CPU cannot run is an error, not a silent
    fallback."""
    value = os.environ.get("BATCHSERVE_ATTENTION_PATH")
    return None if value in (None, "", "auto") else value


def gemm_path() -> str | None:
    """BATCHSERVE_GEMM_PATH (default unset or "auto": the CPU's flags decide): forces the GEMM of bfloat16 models on
    a CPU with bf16 matmul units, "amx" (the native AMX kernel, layers/kernels/amx_gemm.cpp), "amx_emulated" (the
    same kernel with its tile operations in scalar code: slow, runs on any CPU), "avx512_bf16" (bf16 pairs by
    AVX512-BF16, layers/kernels/bf16_gemm.cpp) or "onednn" (oneDNN's packed GEMM);
    to measure or test one path. A path this build or CPU cannot run is an error, not a silent fallback."""
    value = os.environ.get("BATCHSERVE_GEMM_PATH")
    return None if value in (None, "", "auto") else value


def small_gemm_path() -> str | None:
    """BATCHSERVE_SMALL_GEMM_PATH (default unset or "auto": the CPU's flags decide): forces the float32 GEMM of
    decode-sized batches, "avx512" or "avx2" (the native small-M kernel, layers/kernels/small_gemm.cpp, in that ISA)
    or "library" (oneDNN or x @ W at every M); to measure or test one path. A path this build or CPU cannot run is an
    error, not a silent fallback. Read when a model is laid out for the CPU."""
    value = os.environ.get("BATCHSERVE_SMALL_GEMM_PATH")
    return None if value in (None, "", "auto") else value


def lora_path() -> str | None:
    """BATCHSERVE_LORA_PATH (default unset or "auto": the CPU's flags decide): forces the path of the LoRA kernel
    (layers/kernels/lora_tiles.h), "avx512", "avx2" or "portable"; to measure or test one path. A path this build
    or CPU cannot run is an error. Read once, when the first step with adapters runs."""
    value = os.environ.get("BATCHSERVE_LORA_PATH")
    return None if value in (None, "", "auto") else value


def prefill_kernel_path() -> str | None:
    """BATCHSERVE_PREFILL_KERNEL_PATH (default unset or "auto": the CPU's flags decide): forces the native prefill
    kernel of a bfloat16 pool, "amx" (AMX tiles, layers/kernels/prefill_amx.cpp), "avx512_bf16" (the same body with
    its products by AVX512-BF16 dot products, prefill_avx512_bf16.cpp), "amx_emulated" (the AMX kernel with its tile
    operations in scalar code: slow, any AVX-512 CPU) or "avx512" (the attention path's vector kernel, K/V widened to
    float32, prefill_avx512.cpp); to measure or test one path. A path this build or CPU cannot run is an error. Read once, at
    the first prefill."""
    value = os.environ.get("BATCHSERVE_PREFILL_KERNEL_PATH")
    return None if value in (None, "", "auto") else value


def quant_gemm_path() -> str | None:
    """BATCHSERVE_QUANT_GEMM_PATH (default unset or "auto": the CPU's flags decide): forces the quantized GEMM's path
    (layers/kernels/quant_gemm.cpp), "avx512", "avx2" or "portable"; to measure or test one path. A path this build
    or CPU cannot run is an error. Read once, when the first quantized model is laid out."""
    value = os.environ.get("BATCHSERVE_QUANT_GEMM_PATH")
    return None if value in (None, "", "auto") else value


def prefill_attention() -> str | None:
    """BATCHSERVE_PREFILL_ATTENTION (default unset or "auto": the engine's prefill_attention option decides, and on
    auto the pool's dtype and the CPU's flags): "native" (the native kernel, or SDPA where it does not run), "sdpa"
    (torch's fused attention, one call per prompt) or "split" (chunks of at most kernels/paths.py
    SHORT_PREFILL_MAX_ROWS rows native, longer ones SDPA: the default for a bfloat16 pool on an AMX CPU) for prefill
    chunks on the CPU, over the option; to measure or test one way on any CPU."""
    value = os.environ.get("BATCHSERVE_PREFILL_ATTENTION")
    return None if value in (None, "", "auto") else value


def gpu_attention() -> str:
    """BATCHSERVE_GPU_ATTENTION (default "triton"): how attention runs on a CUDA device, "triton" (the paged kernels
    of layers/gpu, which read the K/V pool in place; the torch code where Triton is missing) or "torch" (gather, pad
    and SDPA: the reference, and the "before" of benchmarks/gpu_check.py)."""
    value = os.environ.get("BATCHSERVE_GPU_ATTENTION", "triton")
    if value not in ("triton", "torch"):
        raise ValueError(f"BATCHSERVE_GPU_ATTENTION={value!r}: not one of triton, torch")
    return value


def native_decoder_loop() -> bool:
    """BATCHSERVE_NATIVE_DECODER_LOOP (default "1"): "0" runs every step's decoder layers in Python instead of in one
    native call (the same operators either way; read when a model is laid out for the CPU)."""
    return os.environ.get("BATCHSERVE_NATIVE_DECODER_LOOP", "1") != "0"


def huge_pages() -> bool:
    """BATCHSERVE_HUGE_PAGES (default "1"): "0" keeps the KV pool and the weights' layouts on ordinary pages
    (host/huge_pages.py), for a host where a 2 MiB page's first touch costs more than its TLB saves."""
    return os.environ.get("BATCHSERVE_HUGE_PAGES", "1") != "0"


def start_method() -> str:
    """BATCHSERVE_START_METHOD (default "forkserver"): how batchserve starts its engine core and tensor-parallel rank
    processes, "forkserver" (forked from one interpreter per launching process that imported torch, transformers
    and the engine once) or "spawn" (a fresh interpreter each, importing them again: ~2 CPU-s per start);
    host/children.py says why and what differs."""
    return os.environ.get("BATCHSERVE_START_METHOD") or "forkserver"


def shared_allreduce() -> bool:
    """BATCHSERVE_SHARED_ALLREDUCE (default "1"): "0" all-reduces the tensor-parallel ranks' activations through
    gloo's loopback TCP instead of shared memory (read when the ranks start; docs/parallelism.md)."""
    return os.environ.get("BATCHSERVE_SHARED_ALLREDUCE", "1") != "0"


def grammar_mask_overlap() -> bool:
    """BATCHSERVE_GRAMMAR_OVERLAP (default "1"): "0" fills a step's grammar masks after its forward pass, on the
    step's thread, instead of in a worker thread while the forward pass runs (read when the worker starts)."""
    return os.environ.get("BATCHSERVE_GRAMMAR_OVERLAP", "1") != "0"


def json_integer_digits() -> int:
    """BATCHSERVE_JSON_INTEGER_DIGITS (default "16"): the most digits of a JSON number's integer part that the JSON
    grammar (response_format json_schema / json_object) lets a model write, where the schema gives no range; "0"
    lifts the bound. A model looping on a digit then closes the number instead of running to max_tokens."""
    return int(os.environ.get("BATCHSERVE_JSON_INTEGER_DIGITS", "16"))


def json_fraction_digits() -> int:
    """BATCHSERVE_JSON_FRACTION_DIGITS (default "16"): the most digits after a JSON number's decimal point that the
    JSON grammar lets a model write (an exponent gets at most 3); "0" lifts the bound."""
    return int(os.environ.get("BATCHSERVE_JSON_FRACTION_DIGITS", "16"))


def memory_trace() -> Path | None:
    """BATCHSERVE_MEMORY_TRACE (default unset: off): a file each batchserve process (API server, engine core, body
    parser, grammar compiler, ranks) appends a JSON line of its memory to every BATCHSERVE_MEMORY_TRACE_S seconds:
    RSS, glibc's heap in use and free, Python's object count (host/heap.py; how the soak's growth was explained)."""
    value = os.environ.get("BATCHSERVE_MEMORY_TRACE")
    return Path(value) if value else None


def memory_trace_interval_s() -> float:
    """BATCHSERVE_MEMORY_TRACE_S (default "30"): seconds between two lines of a process's memory trace."""
    return float(os.environ.get("BATCHSERVE_MEMORY_TRACE_S", "30"))


def memory_trace_frames() -> int:
    """BATCHSERVE_MEMORY_TRACE_FRAMES (default "0": off): with a memory trace on, start tracemalloc keeping this many
    frames of each allocation, and add the lines that hold most of Python's memory to each trace line. It slows
    every allocation of the process: a diagnosis only."""
    return int(os.environ.get("BATCHSERVE_MEMORY_TRACE_FRAMES", "0"))


def cache_dir() -> Path:
    """BATCHSERVE_CACHE_DIR (default ~/.cache/batchserve): where GGUF files are converted to, once each."""
    return Path(os.environ.get("BATCHSERVE_CACHE_DIR", Path.home() / ".cache" / "batchserve"))


def kernel_build_dir() -> Path:
    """BATCHSERVE_KERNEL_BUILD_DIR (default <cache dir>/kernels): where the native CPU kernels are built, one folder
    per build key (layers/kernels/build.py)."""
    value = os.environ.get("BATCHSERVE_KERNEL_BUILD_DIR")
    return Path(value) if value else cache_dir() / "kernels"


def api_key() -> str | None:
    """BATCHSERVE_API_KEY (default unset): the key `batchserve serve` requires when --api-key is not given (an empty
    value counts as unset)."""
    return os.environ.get("BATCHSERVE_API_KEY") or None


def hf_export_dir() -> Path:
    """BATCHSERVE_HF_EXPORT (default bench_results/smollm2-hf): the Hugging Face directory benchmarks/export_hf.py
    writes the dequantized default model to and benchmarks/peer_compare.py gives transformers and vLLM."""
    return Path(os.environ.get("BATCHSERVE_HF_EXPORT") or BENCH_RESULTS / "smollm2-hf")


def vllm_python() -> Path:
    """VLLM_PYTHON (default bench_results/vllm-venv/bin/python): the interpreter of the venv holding vLLM's CPU build,
    which benchmarks/peer_compare.py runs vLLM with."""
    return Path(os.environ.get("VLLM_PYTHON") or BENCH_RESULTS / "vllm-venv" / "bin" / "python")
