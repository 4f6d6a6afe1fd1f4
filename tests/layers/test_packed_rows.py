"""oneDNN's packed GEMM sees a few dozen row counts, not one per step length (kernels/projection.cpp packed_rows):
it builds and caches a primitive for each row count, about 0.6 MB for a 576 x 3,072 float32 weight, and a server's
steps bring hundreds of lengths, one more now and then for hours (the soak's slow growth, docs/BENCHMARKS.md)."""

from __future__ import annotations

import pytest
import torch

from batchserve.host.heap import heap_info
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
    lengths = range(max(cpu.rows.small_max_m + 1, 65), min(cpu.rows.packed_max_m, 201))  # all on oneDNN's path
    inputs = {m: torch.randn(m, 576) for m in lengths}
    before = heap_info().in_use_mb
    for m in lengths:
        cpu(inputs[m])
    grown = heap_info().in_use_mb - before
    # 136 lengths: one primitive each took 81 MB; padded to 16 counts per doubling, 26 counts and ~15 MB
    assert grown < 30, f"{grown:.1f} MB more in use after {len(lengths)} step lengths"
    for m in (65, 66, 101, 127, 128, 129, 200):  # the zero rows' results are cut off, the rows' own are the Linear's
        out = cpu(inputs[m])
        assert out.shape == (m, 3072) and out.is_contiguous()
        torch.testing.assert_close(out, linear(inputs[m]), rtol=1e-4, atol=1e-4)


def test_a_padded_row_is_computed_as_in_the_padded_gemm(wide_float32_projection):
    # 101 rows run as 104: each of them exactly as in a 104-row call (other rows do not leak into it)
    _, cpu = wide_float32_projection
    x = torch.randn(104, 576)
    assert torch.equal(cpu(x[:101]), cpu(x)[:101])
