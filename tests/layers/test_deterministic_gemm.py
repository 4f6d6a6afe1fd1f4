"""Deterministic GEMMs (LinearPolicy(deterministic=True), layers/linear.py) on every kernel path, forced: a row's
depend on how many rows share the call or where the row sits; and the output projection's result is float32 from the
GEMM's accumulator on every path (logits never rounded to bf16)."""

from __future__ import annotations

import pytest
import torch

from batchserve.layers import kernels
from batchserve.layers.linear import CpuLinear, LinearPolicy

K, N = 800, 200  # K over several slices of the kernels' K blocking (192 floats, 192 bf16 pairs); a partial panel


def _force(path: str, force_gemm, force_small_gemm, monkeypatch) -> torch.dtype:
    """Force one kernel path; the dtype its projections take."""
    if path.startswith("bf16-"):
        force_gemm(path.removeprefix("bf16-"))  # bf16 units (forced), this GEMM path where M would pick it
        return torch.bfloat16
    force_small_gemm(path)
    return torch.float32


BF16_PATHS = ["bf16-onednn", "bf16-amx_emulated"]
FLOAT_PATHS = ["avx512", "avx2"]
DETERMINISTIC = LinearPolicy(deterministic=True)  # handed to each layer: one GEMM for every M


def _needs_bf16_dot(path: str, native) -> None:
    if path in BF16_PATHS and not native.bf16_gemm_available():
        pytest.skip("no AVX512-BF16 here: deterministic bf16 widens to float32 (the float32 paths' tests)")


@pytest.mark.parametrize("path", BF16_PATHS + FLOAT_PATHS + ["widened"])
def test_row_bits_do_not_depend_on_batch_size_or_position(path, native_kernels, force_gemm, force_small_gemm,
                                                          monkeypatch):  # fmt: skip
    if path == "widened":
        monkeypatch.setenv("BATCHSERVE_LOW_PRECISION_UNITS", "0")
        dtype = torch.bfloat16
    else:
        _needs_bf16_dot(path, native_kernels)
        dtype = _force(path, force_gemm, force_small_gemm, monkeypatch)
    torch.manual_seed(0)
    weight, bias = torch.randn(N, K).to(dtype), torch.randn(N).to(dtype)
    layer = CpuLinear(weight, bias, policy=DETERMINISTIC)
    gate_up = CpuLinear(torch.randn(2 * 64, K).to(dtype), swiglu=True, policy=DETERMINISTIC)
    rows = torch.randn(300, K).to(dtype)
    alone = torch.cat([layer(rows[i : i + 1]) for i in range(300)])
    alone_swiglu = torch.cat([gate_up.silu_and_mul(rows[i : i + 1]) for i in range(300)])
    for batch in (7, 64, 300):
        for start in (0, 300 - batch, (300 - batch) // 2):
            together = layer(rows[start : start + batch])
            assert torch.equal(together, alone[start : start + batch]), (batch, start)
            assert torch.equal(gate_up.silu_and_mul(rows[start : start + batch]), alone_swiglu[start : start + batch])
    # the same row among other rows (not the same neighbours): still the same bits
    shuffled = torch.randperm(300)[:64]
    assert torch.equal(layer(rows[shuffled]), alone[shuffled])
    # and it is the projection: close to x @ W.T + b
    torch.testing.assert_close(alone.float(), rows.float() @ weight.float().T + bias.float(), atol=0.5, rtol=0.02)


def test_deterministic_bf16_uses_one_kernel_for_every_m(native_kernels, force_gemm):
    """On a CPU with AVX512-BF16 a bf16 projection keeps only the bf16 pairs layout (no oneDNN, AMX or [in, out]
    copy: never read in deterministic mode)."""
    if not native_kernels.bf16_gemm_available():
        pytest.skip("no AVX512-BF16 here")
    force_gemm("amx_emulated")
    layer = CpuLinear(torch.randn(256, K).bfloat16(), policy=DETERMINISTIC)  # a shape the AMX kernel takes
    assert layer.bf16_pairs and layer.packed is None and layer.amx_packed is None and layer.weight_t is None
    outside = CpuLinear(torch.randn(256, K).bfloat16())
    assert not outside.bf16_pairs and outside.amx_packed is not None


@pytest.mark.parametrize("path", BF16_PATHS + FLOAT_PATHS + ["library", "widened", "native_off"])
def test_output_projection_is_float32_on_every_gemm_path(path, native_kernels, force_gemm, force_small_gemm,
                                                         monkeypatch):  # fmt: skip
    """float_output: logits in float32 from the accumulator, at decode-sized and prefill-sized M, on every path."""
    if path == "widened":
        monkeypatch.setenv("BATCHSERVE_LOW_PRECISION_UNITS", "0")
    elif path == "native_off":
        force_gemm("onednn")
        monkeypatch.setenv("BATCHSERVE_NATIVE_KERNELS", "0")
        kernels.load.cache_clear()
    else:
        _force(path, force_gemm, force_small_gemm, monkeypatch)
    try:
        torch.manual_seed(1)
        weight = torch.randn(1000, K).bfloat16()  # wider than NARROW_OUT, as an output projection is
        head = CpuLinear(weight, float_output=True)
        assert (head.native is None) == (path == "native_off")
        for m in (1, 3, 12, 70, 600):
            x = torch.randn(m, K).bfloat16()
            logits = head(x)
            assert logits.dtype == torch.float32, (path, m)
            exact = x.double() @ weight.double().T
            torch.testing.assert_close(logits.double(), exact, atol=1e-3, rtol=1e-4)
            # not rounded to bf16 on the way: most values carry bits a bf16 lacks
            assert (logits != logits.bfloat16().float()).float().mean() > 0.9
    finally:
        kernels.load.cache_clear()


def test_model_dtype_projections_stay_in_the_model_dtype(native_kernels):
    layer = CpuLinear(torch.randn(N, K).bfloat16())
    assert layer(torch.randn(5, K).bfloat16()).dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_norm_row_bits_do_not_depend_on_the_rows_address(dtype, native_kernels):
    """RMSNorm sums a row's squares in one order wherever the row sits in memory (a batch's tensor and a row's offset
    in it change its alignment), with and without the fused residual add."""
    torch.manual_seed(2)
    hidden = 576
    weight = torch.rand(hidden).to(dtype) + 0.5
    rows = (torch.randn(64, hidden) * torch.rand(64, 1) * 10).to(dtype)
    residual = torch.randn(64, hidden).to(dtype)
    alone = torch.cat([native_kernels.rms_norm(rows[i : i + 1].clone(), None, weight, 1e-5) for i in range(64)])
    for shift in range(1, 17):  # every alignment of a row's first element (bf16: 2 bytes a step, float32: 4)
        flat = torch.empty(64 * hidden + shift, dtype=dtype)
        moved = flat[shift:].view(64, hidden)
        moved.copy_(rows)
        assert torch.equal(native_kernels.rms_norm(moved, None, weight, 1e-5), alone), shift
    summed = torch.cat([
        native_kernels.rms_norm(rows[i : i + 1].clone(), residual[i : i + 1].clone(), weight, 1e-5) for i in range(64)
    ])  # fmt: skip
    flat = torch.empty(64 * hidden + 5, dtype=dtype)
    moved_residual = flat[5:].view(64, hidden)
    moved_residual.copy_(residual)
    assert torch.equal(native_kernels.rms_norm(rows, moved_residual, weight, 1e-5), summed)
