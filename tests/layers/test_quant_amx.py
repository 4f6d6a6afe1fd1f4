"""Quantized weights on AMX's bf16 tiles (kernels/quant_amx.cpp): each 32-column pair of a weight kept
quantized, dequantized into the tiles' layout, is the weight's value at every code rounded to bf16 (the AVX-512 and
the scalar dequantization bit for bit); the GEMM over those tiles, on emulated tiles anywhere and on AMX where the CPU
has it, is that bf16 weight's product within float32 accumulation; a bf16 model's quantized layer takes it from
AMX_MIN_M rows and keeps W8A8 (or the weight-only path) below, and never in deterministic mode."""

from __future__ import annotations

import pytest
import torch

from batchserve.layers import quantization
from batchserve.layers.linear import LinearPolicy
from batchserve.layers.quantization import QuantizedLinear, QuantScheme, dequantize, quantize

K, N = 384, 88  # N: two whole pairs and a third with 24 columns


def _weight(scheme: QuantScheme, mins: str | None, seed: int = 0):
    """codes, scales, mins (None; float32 ones; GGUF Q4_1's: a float16 m plus 8 x the scale) and the float32 value at
    every code."""
    torch.manual_seed(seed)
    codes, scales = quantize(torch.randn(N, K), scheme)
    group = scheme.group_for(K)
    minimums = None
    if mins is not None:
        minimums = torch.randn(N, K // group) * 0.1
        minimums = minimums.half().float() + 8 * scales if mins == "q4_1" else minimums
    values = dequantize(codes, scales, scheme.bits)
    if minimums is not None:
        values = values + minimums.repeat_interleave(group, dim=1)
    return codes, scales, minimums, values


def _projection(native, codes, scales, scheme, minimums):
    """A native quantized Projection packed for the tiles, on the emulated ones (the weight-only portable path below)."""
    return native.quantized_projection(
        codes, scales, scheme.bits, scheme.group_for(K), None, path="portable", small_max_m=0, mins=minimums,
        bf16_tiles=True, act_block=16, amx_min_m=16, amx_emulated=True,
    )  # fmt: skip


def _tiles_weight(native, projection, vectorized: bool = False) -> torch.Tensor:
    """The weight a Projection's B tiles hold, [pairs x 32, K]: tiles [pairs, K / 32, 2 tiles, 16 kk, 32 (n, j)] of
    k = 32 kb + 2 kk + j and column 32 pair + 16 tile + n."""
    tiles = native.quant_amx_panels(projection, vectorized)
    pairs = tiles.shape[0]
    return tiles.view(pairs, K // 32, 2, 16, 16, 2).permute(0, 2, 4, 1, 3, 5).reshape(pairs * 32, K)


SCHEMES = [QuantScheme(8, None), QuantScheme(8, 32), QuantScheme(4, 32), QuantScheme(4, 128)]
MINS = [None, "float32", "q4_1"]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("mins", MINS, ids=["", "mins", "q4_1_mins"])
def test_a_pairs_tiles_are_its_values_rounded_to_bf16(native_kernels, scheme, mins):
    codes, scales, minimums, values = _weight(scheme, mins)
    projection = _projection(native_kernels, codes, scales, scheme, minimums)
    scalar = _tiles_weight(native_kernels, projection)
    assert scalar.dtype == torch.bfloat16
    assert torch.equal(scalar[N:], torch.zeros_like(scalar[N:]))  # the third pair's missing columns
    got = scalar[:N].float()
    if minimums is None:  # code x scale: one rounding, the same as torch's
        assert torch.equal(got, values.bfloat16().float())
    else:  # an FMA (torch: a product, then a sum): at most one bf16 step apart, almost always equal
        assert ((got - values).abs() <= values.abs() * 2**-8).all()
        assert (got == values.bfloat16().float()).float().mean() > 0.999
    if native_kernels.quant_amx_vectorized():
        assert torch.equal(_tiles_weight(native_kernels, projection, vectorized=True), scalar)


def _accumulation_bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return x.shape[1] * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().T) + 1e-6


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("mins", MINS, ids=["", "mins", "q4_1_mins"])
@pytest.mark.parametrize("rows", [16, 33, 70])  # a row tail alone; a block and one row; two blocks and a tail
def test_the_emulated_tiles_multiply_the_bf16_weight(native_kernels, scheme, mins, rows):
    codes, scales, minimums, _ = _weight(scheme, mins, seed=rows)
    projection = _projection(native_kernels, codes, scales, scheme, minimums)
    weight = _tiles_weight(native_kernels, projection)[:N].float()
    x = (torch.randn(rows, K) * 2).bfloat16()
    args = dict(codes=codes, scales=scales, bits=scheme.bits, group=scheme.group_for(K), mins=minimums)
    got = native_kernels.quant_gemm(
        x, **args, path="portable", small_max_m=0, bf16_tiles=True, act_block=16, amx_min_m=16, amx_emulated=True
    )
    assert got.dtype == torch.float32 and got.shape == (rows, N)
    expected = x.double() @ weight.double().T
    assert ((got.double() - expected).abs() <= _accumulation_bound(x.float(), weight)).all()
    # a layer's Projection on bf16 rows: the same sums, rounded to bf16 once by the kernel
    assert torch.equal(projection(x), got.bfloat16())


@pytest.fixture
def amx_layer(force_gemm, force_quant_gemm):
    """amx_layer(gemm_path, quant_path, scheme): a bf16 model's quantized layer built with those paths forced."""

    def build(gemm_path: str, quant_path: str, scheme: QuantScheme, weight: torch.Tensor) -> QuantizedLinear:
        force_quant_gemm(quant_path)
        force_gemm(gemm_path)
        return QuantizedLinear(weight, None, scheme, quantization.linear_policy("int8", dtype=torch.bfloat16))

    return build


@pytest.mark.parametrize("quant_path", [quantization.W8A8_PATH, "portable"])
@pytest.mark.parametrize("scheme", [QuantScheme(8, None), QuantScheme(4, 32)], ids=lambda s: s.name)
def test_a_bf16_models_layer_takes_the_tiles_from_amx_min_m_rows(native_kernels, amx_layer, quant_path, scheme):
    torch.manual_seed(3)
    weight = torch.randn(N, K)
    on_tiles = amx_layer("amx_emulated", quant_path, scheme, weight)
    without = amx_layer("onednn", quant_path, scheme, weight)
    few, many = torch.randn(on_tiles.AMX_MIN_M - 1, K).bfloat16(), torch.randn(on_tiles.AMX_MIN_M + 20, K).bfloat16()
    assert torch.equal(on_tiles(few), without(few))  # below AMX_MIN_M: the path's own GEMM, bit for bit
    got = on_tiles(many)
    assert got.dtype == torch.bfloat16
    tiles = _tiles_weight(native_kernels, on_tiles.native)[:N]
    expected = (many.double() @ tiles.double().T).float()
    torch.testing.assert_close(got.float(), expected.bfloat16().float(), rtol=2**-7, atol=1e-5)
    if quant_path == quantization.W8A8_PATH:  # not W8A8's result (its activations rounded to int8); the weight-only
        assert not torch.equal(got, without(many))  # path's bf16 tiles round as these do


def test_deterministic_mode_keeps_one_order_per_row(native_kernels, force_gemm, force_quant_gemm):
    """In deterministic mode a row's result may not depend on M: the tiles are never taken."""
    force_quant_gemm(quantization.W8A8_PATH)
    force_gemm("amx_emulated")
    torch.manual_seed(4)
    policy = quantization.linear_policy("int8", dtype=torch.bfloat16, base=LinearPolicy(deterministic=True))
    layer = QuantizedLinear(torch.randn(64, 128), None, QuantScheme(8, None), policy)
    x = torch.randn(40, 128).bfloat16()
    assert torch.equal(layer(x), torch.cat([layer(x[i : i + 1]) for i in range(40)]))


@pytest.mark.parametrize("scheme", [QuantScheme(8, None), QuantScheme(4, 32)], ids=lambda s: s.name)
def test_amx_tiles_multiply_the_bf16_weight_as_the_emulated_ones_do(native_kernels, scheme):
    """On a CPU with AMX the tiles give the bf16 weight's product within float32 accumulation, as the emulation does
    (skipped elsewhere). Not bit for bit: tdpbf16ps sums a tile's pairs in its own order, which the scalar emulation
    does not reproduce (they differ in the last bits of about half the outputs, measured on an AMX Xeon)."""
    if not native_kernels.quant_amx_available():
        pytest.skip("no AMX on this CPU (or this build)")
    codes, scales, minimums, _ = _weight(scheme, "q4_1" if scheme.bits == 4 else None)
    projection = _projection(native_kernels, codes, scales, scheme, minimums)
    weight = _tiles_weight(native_kernels, projection)[:N].float()
    x = torch.randn(70, K).bfloat16()
    args = dict(codes=codes, scales=scales, bits=scheme.bits, group=scheme.group_for(K), mins=minimums)
    common = dict(path="portable", small_max_m=0, bf16_tiles=True, act_block=16, amx_min_m=16)
    on_amx = native_kernels.quant_gemm(x, **args, **common, amx_emulated=False)
    assert on_amx.dtype == torch.float32  # this entry point returns float32: the tiles' sums unrounded
    bound = _accumulation_bound(x.float(), weight)
    for got in (on_amx, native_kernels.quant_gemm(x, **args, **common, amx_emulated=True)):
        assert ((got.double() - x.double() @ weight.double().T).abs() <= bound).all()
