"""oneDNN's packed GEMM sees a few dozen row counts, not one per step length (kernels/projection.cpp packed_rows):
it builds and caches a primitive for each row count, about 0.6 MB for a 576 x 3,072 float32 weight, and a server's
steps bring hundreds of lengths, one more now and then for hours (the soak's slow growth, docs/BENCHMARKS.md)."""

from __future__ import annotations

import pytest
import torch

from batchserve.host.heap import heap_info
from batchserve.layers import kernels
from batchserve.layers.linear import CpuLinear


@pytest.fixture
def wide_float32_projection(native_kernels):
    torch.manual_seed(5)
    linear = torch.nn.Linear(576, 3072, bias=True)  # SmolLM2's gate/up: wide, so oneDNN's packed copy is kept
    cpu = CpuLinear.from_linear(linear)
    if cpu.packed is None or cpu.native is None:
        pytest.skip("this torch build has no oneDNN linear")
    return linear, cpu


@pytest.mark.skipif(heap_info() is None, reason="reads glibc's heap")
def test_step_lengths_on_onednn_add_a_bounded_number_of_primitives(wide_float32_projection):
    linear, cpu = wide_float32_projection
    first = max(cpu.rows.small_max_m, cpu.rows.ukernel_max_m) + 1
    lengths = range(max(first, 65), min(cpu.rows.packed_max_m, 201))  # all on oneDNN's path
    inputs = {m: torch.randn(m, 576) for m in lengths}
    before = heap_info().in_use_mb
    for m in lengths:
        cpu(inputs[m])
    grown = heap_info().in_use_mb - before
    # 136 lengths: one primitive each took 81 MB; padded to 16 counts per doubling, 26 counts and ~15 MB (72 lengths
    # where oneDNN takes rows from 129)
    assert grown < 30, f"{grown:.1f} MB more in use after {len(lengths)} step lengths"
    for m in (129, 130, 150, 191, 192, 193, 200):  # the zero rows' results are cut off, the rows' own are the Linear's
        out = cpu(inputs[m])
        assert out.shape == (m, 3072) and out.is_contiguous()
        torch.testing.assert_close(out, linear(inputs[m]), rtol=1e-4, atol=1e-4)


def test_a_padded_row_is_computed_as_in_the_padded_gemm(wide_float32_projection):
    # 201 rows run as 208: each of them exactly as in a 208-row call (other rows do not leak into it)
    _, cpu = wide_float32_projection
    assert cpu.rows.ukernel_max_m < 201 and cpu.rows.small_max_m < 201  # on oneDNN's path
    x = torch.randn(208, 576)
    assert torch.equal(cpu(x[:201]), cpu(x)[:201])


@pytest.mark.parametrize("out_features", [576, 3072])  # narrow (o) and wide (gate/up)
def test_on_avx512_in_halves_the_brgemm_takes_4_to_128_rows_onednn_the_rest_and_narrow_projections_keep_its_copy(
    native_kernels, monkeypatch, out_features
):
    # a CPU that runs AVX-512 in two halves (kernels.avx512_in_halves): the small-M kernel up to 3 rows, oneDNN's
    # brgemm micro-kernel on its panels from 4 to 128, oneDNN's packed GEMM from 129 on at any length (x @ W for one
    # row only), narrow projections included; each M computes the Linear
    if kernels.small_gemm_path() != "avx512":
        pytest.skip("the avx512 small-M kernel is not this host's path")
    monkeypatch.setattr(kernels, "avx512_in_halves", lambda: True)
    torch.manual_seed(7)
    linear = torch.nn.Linear(576, out_features, bias=True)
    cpu = CpuLinear.from_linear(linear)
    if cpu.native is None:
        pytest.skip("this torch build has no oneDNN linear")
    assert cpu.packed is not None and cpu.small_packed is not None
    assert (cpu.rows.small_min_m, cpu.rows.small_max_m) == (2, CpuLinear.HALVES_SMALL_MAX_M) == (2, 3)
    assert cpu.rows.ukernel_max_m == CpuLinear.HALVES_UKERNEL_MAX_M == 128
    assert cpu.rows.packed_max_m > 2**40  # oneDNN up to any prefill chunk
    for m in (4, 128):  # the Projection hands these rows to the brgemm on the small-M panels
        x = torch.randn(m, 576)
        brgemm = native_kernels.panel_brgemm(x, cpu.small_packed, out_features) + linear.bias.detach()
        assert torch.equal(cpu(x), brgemm)
    for m in (1, 2, 3, 4, 7, 8, 16, 64, 65, 128, 129, 600, 2048):
        x = torch.randn(m, 576)
        torch.testing.assert_close(cpu(x), linear(x), rtol=1e-4, atol=1e-4)


def test_without_halves_narrow_projections_keep_no_onednn_copy(native_kernels, monkeypatch):
    monkeypatch.setattr(kernels, "avx512_in_halves", lambda: False)
    cpu = CpuLinear.from_linear(torch.nn.Linear(576, 576))
    small_path = kernels.small_gemm_path() if cpu.small_packed is not None else "library"
    assert cpu.packed is None and cpu.rows.small_max_m == CpuLinear.SMALL_MAX_M[small_path][True]


def test_on_avx512_in_halves_a_vocabulary_sized_projection_hands_rows_to_onednn_sooner(native_kernels, monkeypatch):
    # oneDNN's packed GEMM ran the default model's output projection faster than the brgemm from 40 rows
    if kernels.small_gemm_path() != "avx512":
        pytest.skip("the avx512 small-M kernel is not this host's path")
    monkeypatch.setattr(kernels, "avx512_in_halves", lambda: True)
    monkeypatch.setattr(CpuLinear, "VOCAB_OUT", 1536)  # a small stand-in for a vocabulary
    torch.manual_seed(11)
    linear = torch.nn.Linear(64, 1600, bias=False)
    cpu = CpuLinear.from_linear(linear)
    assert cpu.rows.ukernel_max_m == CpuLinear.HALVES_VOCAB_UKERNEL_MAX_M == 24
    for m in (4, 24, 25, 64):
        x = torch.randn(m, 64)
        torch.testing.assert_close(cpu(x), linear(x), rtol=1e-4, atol=1e-4)
