"""The AMX GEMM kernel (layers/kernels/amx_gemm.cpp) against float32 matmul, on AMX where the CPU has it and on its
emulated tile operations everywhere, and CpuLinear's choice of it. The emulation covers the packing, blocking, row
tails, bias and rounding; the tile instructions themselves (AmxTiles) run only on a CPU with AMX."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchserve.layers import kernels
from batchserve.layers.linear import CpuLinear, LinearPolicy, swiglu_interleaved

PATHS = ["amx_emulated", "amx"]


def _emulated(native, path: str) -> bool:
    if path == "amx" and not kernels.gemm_path_runs("amx"):
        pytest.skip("this CPU has no AMX (amx_bf16)")
    return path == "amx_emulated"


def _exact(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    out = x.float() @ weight.float().t()
    return out if bias is None else out + bias.float()


def _assert_rounded_once(out: torch.Tensor, exact: torch.Tensor) -> None:
    """Within half a bf16 step of the float32 result (plus float32 summation order): rounded to nearest, not
    truncated."""
    assert ((out.float() - exact).abs() <= exact.abs() * 2**-8 * 1.01 + 1e-4).all()


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [1, 5, 16, 31, 32, 33, 77])
@pytest.mark.parametrize("n, k, with_bias", [(960, 576, False), (64, 1536, True)])
def test_amx_gemm_matches_float32_matmul(native_kernels, path, m, n, k, with_bias):
    """Row tails (M not a multiple of the 32-row block), one and many panels, deep K, a bias: each output is the
    float32 product rounded once to bf16."""
    emulated = _emulated(native_kernels, path)
    torch.manual_seed(m * 31 + n)
    weight, x = (torch.randn(n, k) * 0.05).bfloat16(), torch.randn(m, k).bfloat16()
    bias = torch.randn(n).bfloat16() if with_bias else None
    out = native_kernels.amx_gemm(x, native_kernels.amx_gemm_pack(weight), bias, emulated)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    _assert_rounded_once(out, _exact(x, weight, bias))


def test_amx_and_its_emulation_compute_the_same(native_kernels):
    if not kernels.gemm_path_runs("amx"):
        pytest.skip("this CPU has no AMX (amx_bf16)")
    torch.manual_seed(5)
    weight, x = (torch.randn(96, 64) * 0.1).bfloat16(), torch.randn(40, 64).bfloat16()
    packed = native_kernels.amx_gemm_pack(weight)
    amx, emulated = (native_kernels.amx_gemm(x, packed, None, e).float() for e in (False, True))
    # the same products in float32, summed in another order: at most one bf16 rounding step apart
    assert ((amx - emulated).abs() <= amx.abs().clamp(min=1e-3) * 2**-7).all()


@pytest.mark.parametrize("path", PATHS)
def test_amx_gemm_rows_do_not_depend_on_the_batch(native_kernels, path):
    """A row's result is the same whatever rows share its call (continuous batching mixes them freely), with one
    row block or several (the kernel's two AMX variants)."""
    emulated = _emulated(native_kernels, path)
    torch.manual_seed(6)
    weight, x = (torch.randn(128, 64) * 0.1).bfloat16(), torch.randn(45, 64).bfloat16()
    packed = native_kernels.amx_gemm_pack(weight)
    whole = native_kernels.amx_gemm(x, packed, None, emulated)
    assert torch.equal(whole[40:], native_kernels.amx_gemm(x[40:], packed, None, emulated))
    assert torch.equal(whole[:1], native_kernels.amx_gemm(x[:1], packed, None, emulated))


def test_the_emulation_treats_subnormals_as_the_tiles_do(native_kernels):
    """Subnormal inputs count as zero and a subnormal result is flushed to zero, as on AMX."""
    weight = torch.full((32, 32), 2.0**-125).bfloat16()  # normal in bf16 (and in float32)
    x = torch.full((1, 32), 2.0**-10).bfloat16()
    tiny = native_kernels.amx_gemm(x, native_kernels.amx_gemm_pack(weight), None, True)  # 32 x 2^-135: subnormal
    assert torch.equal(tiny, torch.zeros(1, 32).bfloat16())
    subnormal_in = torch.full((1, 32), 2.0**-130).bfloat16()
    ones = native_kernels.amx_gemm_pack(torch.ones(32, 32).bfloat16())
    assert torch.equal(native_kernels.amx_gemm(subnormal_in, ones, None, True), torch.zeros(1, 32).bfloat16())
    if kernels.gemm_path_runs("amx"):  # and the tiles agree
        assert torch.equal(native_kernels.amx_gemm(x, native_kernels.amx_gemm_pack(weight), None, False), tiny)
        assert torch.equal(native_kernels.amx_gemm(subnormal_in, ones, None, False), torch.zeros(1, 32).bfloat16())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("m", [1, 31, 33, 77])
def test_the_swiglu_epilogue_is_silu_and_mul_of_the_unfused_gemm(native_kernels, path, m):
    emulated = _emulated(native_kernels, path)
    torch.manual_seed(m)
    inter, k = 96, 128
    weight, x = (torch.randn(2 * inter, k) * 0.2).bfloat16(), torch.randn(m, k).bfloat16()
    fused = native_kernels.amx_gemm(x, native_kernels.amx_gemm_pack(swiglu_interleaved(weight)), None, emulated, True)
    gate_up = native_kernels.amx_gemm(x, native_kernels.amx_gemm_pack(weight), None, emulated)
    assert fused.shape == (m, inter)
    unfused = native_kernels.silu_and_mul(gate_up)
    if "avx512f" in kernels.cpu_flags():  # every AMX CPU: one vector body for both
        assert torch.equal(fused, unfused)  # bit for bit, so the layers may take either
    else:  # the compiler's own vectorisation of the scalar loop may split 16 and 96 columns differently
        torch.testing.assert_close(fused, unfused, rtol=2**-7, atol=1e-6)
    gate, up = _exact(x, weight, None).chunk(2, dim=-1)
    torch.testing.assert_close(fused.float(), F.silu(gate) * up, rtol=3e-2, atol=3e-2)


def test_swiglu_interleaves_sixteen_gate_and_sixteen_up_rows_a_panel():
    rows = torch.arange(64).view(64, 1).expand(64, 32).bfloat16()
    order = swiglu_interleaved(rows)[:, 0].long().tolist()
    assert order == [*range(0, 16), *range(32, 48), *range(16, 32), *range(48, 64)]


def test_amx_gemm_rejects_what_it_does_not_take(native_kernels):
    assert not native_kernels.amx_gemm_takes(70, 64) and not native_kernels.amx_gemm_takes(64, 33)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        native_kernels.amx_gemm_pack(torch.zeros(70, 64).bfloat16())
    packed = native_kernels.amx_gemm_pack(torch.zeros(64, 64).bfloat16())
    with pytest.raises(RuntimeError, match="disagree on K"):
        native_kernels.amx_gemm(torch.zeros(3, 96).bfloat16(), packed, None, True)
    with pytest.raises(RuntimeError, match="bfloat16"):
        native_kernels.amx_gemm(torch.zeros(3, 64), packed, None, True)
    with pytest.raises(RuntimeError, match="no bias with swiglu"):
        native_kernels.amx_gemm(torch.zeros(3, 64).bfloat16(), packed, torch.zeros(64).bfloat16(), True, True)


@pytest.mark.parametrize("path", PATHS)
def test_cpu_linear_takes_the_amx_kernel_below_its_row_limit(native_kernels, force_gemm, path, monkeypatch):
    _emulated(native_kernels, path)
    force_gemm(path)
    monkeypatch.setattr(CpuLinear, "AMX_MAX_M", 40)  # above it, oneDNN (kept small: the emulation is slow)
    torch.manual_seed(7)
    weight, bias = (torch.randn(96, 64) * 0.1).bfloat16(), torch.randn(96).bfloat16()
    linear = CpuLinear(weight, bias)
    if not linear.packed_only:
        pytest.skip("this torch build has no oneDNN bf16 linear")
    assert linear.amx_packed is not None and linear.amx_emulated == (path == "amx_emulated")
    for m in (1, 3, 39, 40, 70):
        x = torch.randn(m, 64).bfloat16()
        out = linear(x)
        if m < 40:
            assert torch.equal(out, native_kernels.amx_gemm(x, linear.amx_packed, bias, linear.amx_emulated))
        torch.testing.assert_close(out.float(), _exact(x, weight, bias), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("path", PATHS)
def test_a_gate_up_cpu_linear_fuses_silu_and_mul_below_the_row_limit(native_kernels, force_gemm, path, monkeypatch):
    emulated = _emulated(native_kernels, path)
    force_gemm(path)
    monkeypatch.setattr(CpuLinear, "AMX_MAX_M", 40)
    torch.manual_seed(3)
    weight = (torch.randn(128, 64) * 0.2).bfloat16()
    linear = CpuLinear(weight, swiglu=True)
    if not linear.packed_only:
        pytest.skip("this torch build has no oneDNN bf16 linear")
    assert linear.swiglu
    unfused = native_kernels.amx_gemm_pack(weight)
    for m in (1, 39, 40, 70):
        x = torch.randn(m, 64).bfloat16()
        out = linear.silu_and_mul(x)
        if m < 40:  # the fused kernel
            expected = native_kernels.silu_and_mul(native_kernels.amx_gemm(x, unfused, None, emulated))
        else:  # oneDNN, then silu_and_mul
            expected = native_kernels.silu_and_mul(linear(x))
        assert torch.equal(out, expected)
        # the plain forward keeps gate, then up (the interleaved panels are read only through silu_and_mul)
        torch.testing.assert_close(linear(x).float(), _exact(x, weight, None), rtol=2e-2, atol=2e-2)
    assert not CpuLinear(weight, torch.zeros(128).bfloat16(), swiglu=True).swiglu  # a bias: not fused
    force_gemm("onednn")
    assert not CpuLinear(weight, swiglu=True).swiglu


@pytest.mark.parametrize("path", PATHS)
def test_the_mlp_of_a_fused_gate_up_runs_in_row_tiles(native_kernels, force_gemm, path, monkeypatch):
    """swiglu_mlp: tiles of SWIGLU_TILE_M rows (the last one short), each through the fused kernel and the down
    projection, equal the tile-by-tile calls and the float32 MLP; an unfused gate/up (oneDNN) takes every row at once."""
    emulated = _emulated(native_kernels, path)
    force_gemm(path)
    monkeypatch.setattr(CpuLinear, "AMX_MAX_M", 40)
    monkeypatch.setattr(CpuLinear, "SWIGLU_TILE_M", 16)
    torch.manual_seed(5)
    w_gate_up, w_down = (torch.randn(128, 64) * 0.2).bfloat16(), (torch.randn(64, 64) * 0.2).bfloat16()
    gate_up, down = CpuLinear(w_gate_up, swiglu=True), CpuLinear(w_down)
    if not gate_up.packed_only:
        pytest.skip("this torch build has no oneDNN bf16 linear")
    assert gate_up.swiglu and gate_up.amx_emulated == emulated and gate_up.rows.swiglu_tile_m == 16
    for m in (1, 16, 17, 50):
        x = torch.randn(m, 64).bfloat16()
        out = native_kernels.swiglu_mlp(x, gate_up.native, down.native)
        tiles = [down(gate_up.silu_and_mul(x[i : i + 16])) for i in range(0, m, 16)]
        assert torch.equal(out, torch.cat(tiles))
        gate, up = (x.float() @ w_gate_up.float().t()).chunk(2, dim=-1)
        exact = (F.silu(gate) * up) @ w_down.float().t()
        torch.testing.assert_close(out.float(), exact, rtol=3e-2, atol=3e-2)
    force_gemm("onednn")
    gate_up, down = CpuLinear(w_gate_up, swiglu=True), CpuLinear(w_down)
    x = torch.randn(50, 64).bfloat16()
    assert torch.equal(native_kernels.swiglu_mlp(x, gate_up.native, down.native), down(gate_up.silu_and_mul(x)))


@pytest.mark.parametrize("path", PATHS)
def test_without_calls_of_onednn_rows_the_amx_kernel_takes_every_m_and_no_onednn_copy_is_made(
    native_kernels, force_gemm, path, monkeypatch
):
    """max_rows under the AMX row limit: one layout of the weight, not two; a call longer than max_rows (none should
    come) still computes, by the AMX kernel."""
    _emulated(native_kernels, path)
    force_gemm(path)
    monkeypatch.setattr(CpuLinear, "AMX_MAX_M", 40)
    torch.manual_seed(5)
    weight, bias = (torch.randn(96, 64) * 0.1).bfloat16(), torch.randn(96).bfloat16()
    if not CpuLinear(weight, bias, policy=LinearPolicy(max_rows=40)).packed_only:
        pytest.skip("this torch build has no oneDNN bf16 linear")
    assert CpuLinear(weight, bias, policy=LinearPolicy(max_rows=40)).packed is not None  # rows 40 reach oneDNN
    linear = CpuLinear(weight, bias, policy=LinearPolicy(max_rows=39))
    assert linear.packed is None and linear.weight_t is None and linear.amx_packed is not None
    for m in (1, 39, 70):
        x = torch.randn(m, 64).bfloat16()
        assert torch.equal(linear(x), native_kernels.amx_gemm(x, linear.amx_packed, bias, linear.amx_emulated))
    gate_up = CpuLinear((torch.randn(128, 64) * 0.2).bfloat16(), swiglu=True, policy=LinearPolicy(max_rows=39))
    assert gate_up.swiglu and gate_up.packed is None
    x = torch.randn(70, 64).bfloat16()
    assert torch.equal(gate_up.silu_and_mul(x), native_kernels.silu_and_mul(gate_up(x)))


def test_cpu_linear_keeps_onednn_where_told_or_where_the_shape_does_not_fit(native_kernels, force_gemm):
    force_gemm("onednn")
    assert CpuLinear((torch.randn(96, 64) * 0.1).bfloat16()).amx_packed is None
    force_gemm("amx_emulated")
    weight = (torch.randn(70, 64) * 0.1).bfloat16()
    linear = CpuLinear(weight)  # 70 columns: not whole panels
    assert linear.amx_packed is None
    x = torch.randn(5, 64).bfloat16()
    torch.testing.assert_close(linear(x).float(), F.linear(x.float(), weight.float()), rtol=2e-2, atol=2e-2)
    assert CpuLinear(torch.randn(96, 64)).amx_packed is None  # float32 weights never take it


def test_a_forced_gemm_path_must_exist_and_run_here(force_gemm):
    force_gemm("tiles")
    with pytest.raises(ValueError, match="not one of auto"):
        kernels.bf16_gemm_path()
    if not kernels.gemm_path_runs("amx"):
        force_gemm("amx")
        with pytest.raises(ValueError, match="not runnable on this CPU"):
            kernels.bf16_gemm_path()


def test_the_cpu_flags_choose_amx_only_where_it_runs(native_kernels, force_gemm, monkeypatch):
    force_gemm("auto")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: "flags\t\t: fpu avx512f avx512_bf16")  # no AMX: bf16 pairs
    assert kernels.bf16_gemm_path() == "avx512_bf16"
    kernels.bf16_gemm_path.cache_clear()
    monkeypatch.setattr(kernels, "cpu_flags", lambda: "flags\t\t: fpu avx512f avx512_bf16 amx_tile amx_bf16")
    # the kernel also asks Linux for the tiles; without them the pairs, as on a CPU without AMX
    expected = "amx" if native_kernels.amx_gemm_available() else "avx512_bf16"
    assert kernels.bf16_gemm_path() == expected
