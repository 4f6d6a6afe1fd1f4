"""Fixtures that force one of the CPU's attention paths for a test, whatever the CPU would choose; a test module
takes one by importing it."""

from __future__ import annotations

import pytest

from batchserve.layers.attention import preferred_prefill_method


@pytest.fixture
def force_prefill(monkeypatch):
    """force_prefill(path): prefill chunks take `path` ("native" or "sdpa"), whatever the CPU. The choice is cached
    per pool dtype, so it is cleared around the test."""

    def force(path: str) -> None:
        monkeypatch.setenv("BATCHSERVE_PREFILL_ATTENTION", path)
        preferred_prefill_method.cache_clear()

    yield force
    preferred_prefill_method.cache_clear()


@pytest.fixture
def force_gemm(monkeypatch):
    """force_gemm(path): bfloat16 projections on bf16 matmul units take GEMM `path` ("amx", "amx_emulated" or
    "onednn"), and the CPU counts as having those units; the cached choice is cleared around the test. Layouts are
    made when a model or CpuLinear is built, so force before building one."""
    from batchserve.layers import kernels

    def force(path: str) -> None:
        monkeypatch.setenv("BATCHSERVE_GEMM_PATH", path)
        monkeypatch.setenv("BATCHSERVE_LOW_PRECISION_UNITS", "1")
        kernels.bf16_gemm_path.cache_clear()

    yield force
    kernels.bf16_gemm_path.cache_clear()


def _path_forcer(monkeypatch, what: str, variable: str, runs, chosen):
    """force(path) for one kernel-table operation: `variable` set to `path` and the cached choice `chosen` cleared;
    the test skips where this build or CPU cannot run `path`."""

    def force(path: str) -> None:
        if not runs(path):
            pytest.skip(f"the {path} {what} is not built here or not runnable on this CPU")
        monkeypatch.setenv(variable, path)
        chosen.cache_clear()

    return force


@pytest.fixture
def force_small_gemm(monkeypatch):
    """force_small_gemm(path): float32 projections take small-M GEMM `path` ("avx512", "avx2" or "library"). The
    cached choice is cleared around the test; layouts are made when a model or CpuLinear is built, so force before
    building one."""
    from batchserve.layers import kernels

    yield _path_forcer(
        monkeypatch, "small-M GEMM", "BATCHSERVE_SMALL_GEMM_PATH", kernels.small_gemm_path_runs, kernels.small_gemm_path
    )
    kernels.small_gemm_path.cache_clear()


@pytest.fixture
def force_quant_gemm(monkeypatch):
    """force_quant_gemm(path): quantized projections built after this take `path`."""
    from batchserve.layers import quantization

    yield _path_forcer(
        monkeypatch,
        "quantized GEMM",
        "BATCHSERVE_QUANT_GEMM_PATH",
        quantization.quant_gemm_path_runs,
        quantization.quant_gemm_path,
    )
    quantization.quant_gemm_path.cache_clear()


@pytest.fixture
def force_lora_path(monkeypatch):
    """force_lora_path(path): the LoRA kernel takes `path` ("avx512_bf16", "avx512", "avx2" or "portable") in the steps made after
    this. The cached choice is cleared around the test."""
    from batchserve.layers import kernels

    yield _path_forcer(monkeypatch, "LoRA kernel", "BATCHSERVE_LORA_PATH", kernels.lora_path_runs, kernels.lora_path)
    kernels.lora_path.cache_clear()


# /proc/cpuinfo flags of each host class the docs' per-class tables name
HOST_CLASS_FLAGS = {
    "avx2": "fpu sse4_2 avx avx2 fma",
    "avx512": "fpu sse4_2 avx avx2 fma avx512f avx512bw avx512vl avx512_vnni",
    "avx512_bf16": "fpu sse4_2 avx avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16",
    "amx": "fpu sse4_2 avx avx2 fma avx512f avx512bw avx512vl avx512_vnni avx512_bf16 amx_bf16 amx_tile amx_int8",
}


@pytest.fixture
def force_auto_flags(monkeypatch):
    """force_auto_flags(host_class): quantization auto's rule reads that class's CPU flags (HOST_CLASS_FLAGS) and a
    build with every kernel; the kernels themselves still run on this CPU's paths, so the choice is tested on any
    host."""
    from batchserve.engine import auto_quantization
    from batchserve.layers.kernels.paths import OPERATIONS

    every = frozenset((op, p.isa) for op, o in OPERATIONS.items() for p in o.paths if p.isa is not None)

    def force(host_class: str) -> None:
        monkeypatch.setattr(auto_quantization, "host", lambda: (HOST_CLASS_FLAGS[host_class], every))

    return force


@pytest.fixture
def force_prefill_kernel(monkeypatch):
    """force_prefill_kernel(path): a bfloat16 pool's native prefill kernel takes `path` ("amx", "amx_emulated" or
    "avx512"; skipped where it cannot run here). The cached choices are cleared around the test."""
    from batchserve.layers import kernels

    def clear() -> None:
        kernels.prefill_kernel_path.cache_clear()
        preferred_prefill_method.cache_clear()

    force = _path_forcer(
        monkeypatch,
        "prefill kernel",
        "BATCHSERVE_PREFILL_KERNEL_PATH",
        kernels.prefill_kernel_path_runs,
        kernels.prefill_kernel_path,
    )

    def force_and_clear(path: str) -> None:
        force(path)
        clear()

    yield force_and_clear
    clear()
