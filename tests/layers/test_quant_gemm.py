"""Weights kept quantized (layers/quantization.py, kernels/quant_gemm.cpp): quantize/dequantize round trips
within the format's bound; each quantized GEMM path, forced, equals the float32 product of the dequantized weight
within float32 rounding, at decode-sized and prefill-sized M; the quantized Projection is a drop-in (bias, bf16 rows,
the native decoder loop's object)."""

from __future__ import annotations

import pytest
import torch

from batchserve.config import ConfigError
from batchserve.host import huge_pages
from batchserve.layers import kernels, quantization
from batchserve.layers.linear import LinearPolicy
from batchserve.layers.quantization import (
    QuantizedLinear,
    QuantScheme,
    dequantize,
    pack_int4,
    parse_quantization,
    quantize,
    unpack_int4,
)

SCHEMES = [QuantScheme(8, None), QuantScheme(4, 32), QuantScheme(4, 64), QuantScheme(4, 128)]


@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
def test_round_trip_within_half_a_step(scheme):
    torch.manual_seed(0)
    weight = torch.randn(48, 256) * torch.rand(48, 1) * 3
    codes, scales = quantize(weight, scheme)
    restored = dequantize(codes, scales, scheme.bits)
    step = scales.abs().repeat_interleave(scheme.group_for(256), dim=1)
    # round to nearest: at most half a step from the original (plus float32 rounding of w / s and q * s); int4's
    # end codes -8 and 7, where values clamp: the sign kept, the magnitude no larger, within two steps
    if scheme.bits == 4:
        nibbles = unpack_int4(codes)
        clamped = (nibbles == 0) | (nibbles == 15)
        assert (restored[clamped] * weight[clamped] >= 0).all()
        assert (restored[clamped].abs() <= weight[clamped].abs() * (1 + 1e-6) + step[clamped] * 0.5).all()
    else:
        clamped = torch.zeros_like(weight, dtype=torch.bool)
    assert ((restored - weight).abs() <= step * torch.where(clamped, 2.0, 0.5) * (1 + 1e-5)).all()
    # quantizing the dequantized weight again changes nothing: codes and scales are a fixed point
    again_codes, again_scales = quantize(restored, scheme)
    assert torch.equal(again_codes, codes)
    torch.testing.assert_close(again_scales, scales, rtol=1e-6, atol=0)


def test_int4_packing_is_the_q4_0_nibble_order():
    values = torch.arange(64).remainder(16).reshape(1, 64)
    packed = pack_int4(values)
    assert packed.shape == (1, 32)
    # byte j of a 32-k subblock: k = j in the low nibble, k = j + 16 in the high one
    assert packed[0, 3].item() == (values[0, 3] | (values[0, 19] << 4)).item()
    assert torch.equal(unpack_int4(packed), values.to(torch.int16))


def test_parse_and_refusals():
    assert parse_quantization("none") is None
    assert parse_quantization("int4") == QuantScheme(4, 32)
    assert parse_quantization("int4_g128") == QuantScheme(4, 128)
    with pytest.raises(ConfigError, match="not one of"):
        parse_quantization("int3")
    with pytest.raises(ConfigError, match="int4_g32, int4_g64 would work"):
        quantize(torch.randn(8, 576), QuantScheme(4, 128))


def _native():
    native = kernels.load()
    if native is None:
        pytest.skip("native kernels not built here")
    return native


def _bound(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """float32 accumulation over K terms: K * eps * sum |x_k w_k|, per output element."""
    return x.shape[1] * torch.finfo(torch.float32).eps * (x.abs().double() @ weight.abs().double().T)


WEIGHT_ONLY_PATHS = [p for p in quantization.QUANT_GEMM_PATHS if p != quantization.W8A8_PATH]


@pytest.mark.parametrize("path", WEIGHT_ONLY_PATHS)
@pytest.mark.parametrize("scheme", SCHEMES, ids=lambda s: s.name)
@pytest.mark.parametrize("rows", [1, 3, 7, 80])  # 80: above SMALL_MAX_M, the dequantized tiles
def test_each_path_equals_the_dequantized_product(force_quant_gemm, path, scheme, rows):
    _native()
    force_quant_gemm(path)
    torch.manual_seed(rows)
    weight, bias = torch.randn(80, 384), torch.randn(80)
    layer = QuantizedLinear(weight, bias, scheme)
    x = torch.randn(rows, 384)
    assert layer.codes is not None  # the weight-only paths read the codes as stored
    reference = dequantize(layer.codes, layer.scales, scheme.bits)
    expected = x.double() @ reference.double().T + bias.double()
    got = layer(x)
    assert got.dtype == torch.float32 and got.shape == (rows, 80)
    assert ((got.double() - expected).abs() <= _bound(x, reference) + 1e-6).all()
    # the quantization error against the float weight stays within the format's: half a step per weight
    step = layer.scales.abs().repeat_interleave(layer.group, dim=1)
    format_bound = 2 * (x.abs().double() @ step.double().T) + _bound(x, weight)  # two steps: int4's clamped ends
    assert ((got.double() - (x.double() @ weight.double().T + bias.double())).abs() <= format_bound + 1e-5).all()


def _activation_steps(x: torch.Tensor, block: int) -> torch.Tensor:
    """Per element of x [M, K], the int8 step of its block of `block` k (0: the whole row): largest magnitude / 127."""
    m, k = x.shape
    block = block or k
    amax = x.reshape(m, k // block, block).abs().amax(-1, keepdim=True) / 127.0
    return amax.expand(-1, -1, block).reshape(m, k)


# and int4 with one scale a row: 4-bit codes whose sums are scaled at the end, not per group
@pytest.mark.parametrize("scheme", [*SCHEMES, QuantScheme(4, None)], ids=lambda s: s.name)
# minimums: none, float32 ones, or GGUF Q4_1's (a float16 m plus 8 x the scale: the kernel packs m in float16 and adds
# 8 x the scale back)
@pytest.mark.parametrize("with_mins", [None, "float32", "q4_1"], ids=["", "mins", "q4_1_mins"])
@pytest.mark.parametrize("rows", [1, 3, 9, 80])
def test_w8a8_equals_the_dequantized_product_within_activation_rounding(force_quant_gemm, scheme, with_mins, rows):
    """W8A8 rounds each activation to the nearest int8 step of its row's ACT_BLOCK k (a tie either way: still within
    half a step); the integer products are exact, so the result is the dequantized weight's product within half a step
    per activation, plus float32 rounding of the scaled partial sums."""
    _native()
    force_quant_gemm(quantization.W8A8_PATH)
    torch.manual_seed(rows)
    out_features = 88  # two pairs of 16-column blocks and a part of a third pair's second block
    weight, bias = torch.randn(out_features, 384), torch.randn(out_features)
    codes, scales = quantize(weight, scheme)
    group = scheme.group_for(384)
    mins = torch.randn(out_features, 384 // group) * 0.1 if with_mins else None
    if with_mins == "q4_1":
        mins = mins.half().float() + 8 * scales
    layer = QuantizedLinear.from_codes(codes, scales, scheme, bias=bias, mins=mins)
    assert layer.codes is None and layer.scales is None  # every M takes W8A8: only the kernel's repacked copy kept
    x = torch.randn(rows, 384) * torch.rand(rows, 1) * 4
    reference = dequantize(codes, scales, scheme.bits)
    if with_mins:
        reference = reference + mins.repeat_interleave(group, dim=1)
    expected = x.double() @ reference.double().T + bias.double()
    steps = _activation_steps(x, layer.ACT_BLOCK)
    bound = 0.5 * (steps.double() @ reference.abs().double().T) * (1 + 1e-5) + _bound(x, reference) + 1e-6
    got = layer(x)
    assert got.shape == (rows, out_features)
    assert ((got.double() - expected).abs() <= bound).all()
    # activations rounded: not the weight-only product (that one is within float32 rounding)
    assert ((got.double() - expected).abs() > _bound(x, reference) + 1e-6).any()


def test_w8a8_is_packed_only_for_whole_subblocks():
    """GGUF Q6_K's groups of 16 are not packed for W8A8: those layers take the avx512 register path, bit for bit."""
    native = _native()
    if not quantization.quant_gemm_path_runs(quantization.W8A8_PATH):
        pytest.skip("no AVX512-VNNI here")
    torch.manual_seed(0)
    codes, scales = quantize(torch.randn(32, 128), QuantScheme(4, 32))
    scales16 = scales.repeat_interleave(2, dim=1) * torch.rand(32, 8)
    x = torch.randn(5, 128)
    args = dict(codes=codes, scales=scales16, bits=4, group=16, small_max_m=64)
    assert torch.equal(native.quant_gemm(x, path="avx512_vnni", **args), native.quant_gemm(x, path="avx512", **args))


@pytest.mark.parametrize("scheme", [QuantScheme(8, None), QuantScheme(4, 32)], ids=lambda s: s.name)
def test_w8a8_reads_bf16_rows_and_writes_bf16_over_many_row_chunks(force_quant_gemm, scheme):
    """A bf16 model's rows enter W8A8 as they are and its output is written in bf16 directly: the float32 result
    rounded once. K = 4096 splits 100 rows into several chunks (the rows whose codes stay in L2); each row's result
    is still the one it gets alone."""
    _native()
    force_quant_gemm(quantization.W8A8_PATH)
    torch.manual_seed(1)
    layer = QuantizedLinear(torch.randn(48, 4096), None, scheme)
    x = torch.randn(100, 4096).to(torch.bfloat16)
    got = layer(x)
    assert got.dtype == torch.bfloat16
    as_float = layer(x.float())
    assert torch.equal(got, as_float.to(torch.bfloat16))
    assert torch.equal(as_float, torch.cat([layer(x[i : i + 1].float()) for i in range(100)]))


def _mappings_advised_huge() -> int:
    """How many of this process's mappings carry the huge page hint (`hg` in /proc/self/smaps' VmFlags)."""
    with open("/proc/self/smaps") as f:
        return sum(1 for line in f if line.startswith("VmFlags:") and " hg" in line)


@pytest.mark.parametrize("knob", ["0", "1"])
def test_the_packed_weight_asks_for_huge_pages_only_where_the_knob_allows(force_quant_gemm, monkeypatch, knob):
    """BATCHSERVE_HUGE_PAGES=0 keeps the weights' layouts on ordinary pages, the packed W8A8 codes included."""
    if huge_pages.host_cannot() is not None:
        pytest.skip(huge_pages.host_cannot())
    _native()
    force_quant_gemm(quantization.W8A8_PATH)
    monkeypatch.setenv("BATCHSERVE_HUGE_PAGES", knob)
    codes = torch.randint(0, 256, (8192, 2048), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    before = _mappings_advised_huge()
    layer = QuantizedLinear.from_codes(codes, torch.full((8192, 128), 1e-3), QuantScheme(4, 32))
    assert layer(torch.randn(1, 4096)).abs().sum() > 0  # packed at its first call, if not at load
    assert (_mappings_advised_huge() > before) == (knob == "1")


def test_a_weight_packed_on_huge_pages_multiplies_as_its_pieces(force_quant_gemm, monkeypatch):
    """From 8 MiB up a packed weight lies in its own 2 MiB-aligned mapping with the huge page hint
    (quant_w8a8_pack.cpp): 32768 x 4096 int4 in groups of 32 (64 MiB of codes, 8 MiB of float16 scales, both there)
    gives, at the batch-1 and batch-2 tiles that prefetch and at 3 rows, the bits of its 16 slices of 2048 columns,
    each packed in ordinary memory (a column's result does not depend on the others)."""
    _native()
    monkeypatch.setenv("BATCHSERVE_HUGE_PAGES", "1")  # the suite turns them off (tests/conftest.py)
    force_quant_gemm(quantization.W8A8_PATH)
    g = torch.Generator().manual_seed(0)
    n, k, scheme = 32768, 4096, QuantScheme(4, 32)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scales = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half().float()
    whole = QuantizedLinear.from_codes(codes, scales, scheme)
    pieces = [QuantizedLinear.from_codes(codes[i : i + 2048], scales[i : i + 2048], scheme) for i in range(0, n, 2048)]
    x = torch.randn(3, k, generator=g).to(torch.bfloat16)
    for rows in (1, 2, 3):
        got = whole(x[:rows])
        assert got.shape == (rows, n) and got.abs().sum() > 0
        assert torch.equal(got, torch.cat([piece(x[:rows]) for piece in pieces], dim=1))


def test_native_dequantize_matches_torch():
    native = _native()
    for scheme in SCHEMES:
        codes, scales = quantize(torch.randn(40, 256), scheme)
        group = scheme.group_for(256)
        assert torch.equal(
            native.quant_dequantize(codes, scales, scheme.bits, group), dequantize(codes, scales, scheme.bits)
        )


@pytest.mark.parametrize("path", [quantization.W8A8_PATH, "avx512", "portable"])
def test_rows_do_not_depend_on_the_batch(force_quant_gemm, path):
    """Below SMALL_MAX_M (W8A8: at every M) a row's result is the same bits whatever else shares the call."""
    _native()
    force_quant_gemm(path)
    layer = QuantizedLinear(torch.randn(64, 128), None, QuantScheme(4, 32))
    x = torch.randn(9, 128)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(9)])
    assert torch.equal(layer(x), alone)


def test_bf16_rows_and_the_torch_fallback_agree(force_quant_gemm):
    _native()
    force_quant_gemm("avx512" if quantization.quant_gemm_path_runs("avx512") else "portable")  # weight-only
    layer = QuantizedLinear(torch.randn(64, 96), torch.randn(64), QuantScheme(8, None))
    x = torch.randn(5, 96).to(torch.bfloat16)
    native_out = layer(x)
    assert native_out.dtype == torch.bfloat16
    torch.testing.assert_close(native_out, layer._torch_forward(x), rtol=1e-2, atol=1e-2)
    gate_up = layer.silu_and_mul(x.float())
    gate, up = layer(x.float()).chunk(2, dim=-1)
    torch.testing.assert_close(gate_up, torch.nn.functional.silu(gate) * up)


@pytest.mark.parametrize("units", ["1", "0"])
def test_a_bf16_model_multiplies_many_rows_on_bf16_tiles(monkeypatch, force_quant_gemm, units):
    """Built for a bfloat16 model on a CPU with bf16 units, a quantized layer's GEMM of many rows rounds the
    dequantized tiles and the activations to bf16 (the bf16 model's own GEMM precision, on its fast units); few rows
    keep the register kernel, bit for bit; float32 models and CPUs without the units keep float32 tiles."""
    _native()
    force_quant_gemm("avx512")  # the path with bf16 tiles (W8A8 multiplies the codes in place instead)
    monkeypatch.setenv("BATCHSERVE_LOW_PRECISION_UNITS", units)
    torch.manual_seed(0)
    weight = torch.randn(96, 256)
    plain = QuantizedLinear(weight, None, QuantScheme(8, None))
    bf16_model = quantization.linear_policy("int8", dtype=torch.bfloat16)
    tiled = QuantizedLinear(weight, None, QuantScheme(8, None), bf16_model)
    float32_model = quantization.linear_policy("int8", dtype=torch.float32)
    assert not QuantizedLinear(weight, None, QuantScheme(8, None), float32_model).bf16_tiles
    assert tiled.bf16_tiles == (units == "1")
    logits = QuantizedLinear.from_codes(plain.codes, plain.scales, plain.scheme, float_output=True, policy=bf16_model)
    assert not logits.bf16_tiles  # logits stay float32: never bf16 tiles
    few, many = torch.randn(tiled.SMALL_MAX_M_BF16_TILES, 256), torch.randn(80, 256)
    assert torch.equal(tiled(few), plain(few))
    reference = dequantize(plain.codes, plain.scales, 8)
    if units == "1":
        expected = torch.mm(many.bfloat16(), reference.bfloat16().T).float()  # the bf16 GEMM, bf16 out
        torch.testing.assert_close(tiled(many), expected, rtol=8e-3, atol=1e-2)
        assert not torch.equal(tiled(many), plain(many))  # rounded: not the float32 tiles' result
    else:
        assert torch.equal(tiled(many), plain(many))


def test_the_policy_path_is_taken_and_a_forced_path_still_wins(force_quant_gemm):
    """LinearPolicy.quant_gemm_path (quantization auto's weight-only path) is the path a layer runs, not the kernel
    table's; a forced BATCHSERVE_QUANT_GEMM_PATH still wins over it."""
    _native()
    torch.manual_seed(0)
    scheme, weight, x = QuantScheme(4, 32), torch.randn(80, 384), torch.randn(3, 384)
    policy = LinearPolicy(quant_gemm_path="portable")
    layer = QuantizedLinear(weight, None, scheme, policy)
    assert layer.gemm_path == "portable" and layer.codes is not None  # weight-only: the codes as stored
    reference = dequantize(layer.codes, layer.scales, scheme.bits)  # no activation rounding, unlike W8A8
    assert ((layer(x).double() - x.double() @ reference.double().T).abs() <= _bound(x, reference) + 1e-6).all()
    assert QuantizedLinear(weight, None, scheme).gemm_path == quantization.quant_gemm_path()
    other = next(
        (p for p in quantization.QUANT_GEMM_PATHS if p != "portable" and quantization.quant_gemm_path_runs(p)), None
    )
    if other is None:
        pytest.skip("no native quantized GEMM path but portable runs here")
    force_quant_gemm(other)
    assert QuantizedLinear(weight, None, scheme, policy).gemm_path == other
