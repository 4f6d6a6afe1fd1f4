"""On one intra-op thread the AVX-512 small-M float32 kernel keeps only the fewest rows and oneDNN's packed GEMM takes
the rest, narrow projections included (CpuLinear.ONE_THREAD_SMALL_MAX_M); more threads keep the earlier schedule."""

from __future__ import annotations

import pytest
import torch

from batchserve.layers import kernels
from batchserve.layers.linear import CpuLinear


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_the_schedule_hands_rows_to_onednn_earlier_on_one_thread_only():
    one = CpuLinear.row_schedule_for("avx512", narrow=True, threads=1)
    two = CpuLinear.row_schedule_for("avx512", narrow=True, threads=2)
    assert one.small_max_m == CpuLinear.ONE_THREAD_SMALL_MAX_M["avx512"]
    assert two.small_max_m == CpuLinear.SMALL_MAX_M["avx512"][True] > one.small_max_m
    for path in ("avx2", "library"):  # measured on the AVX-512 kernel alone
        assert CpuLinear.row_schedule_for(path, threads=1) == CpuLinear.row_schedule_for(path, threads=2)


def test_a_narrow_projection_on_one_thread_takes_onednn_above_the_fewest_rows(native_kernels, one_thread):
    if kernels.small_gemm_path() != "avx512":
        pytest.skip("the small-M kernel's AVX-512 path does not run here")
    torch.manual_seed(3)
    linear = torch.nn.Linear(576, 960, bias=True)  # SmolLM2's qkv: narrow, packed by oneDNN only on one thread
    cpu = CpuLinear.from_linear(linear)
    if cpu.native is None:
        pytest.skip("the native projection is not built here")
    if cpu.packed is None:
        pytest.skip("this torch build has no oneDNN linear")
    few = CpuLinear.ONE_THREAD_SMALL_MAX_M["avx512"]
    with torch.inference_mode():
        for m in (1, 2, few, few + 1, 16, 64):
            x = torch.randn(m, 576)
            torch.testing.assert_close(cpu(x), linear(x), rtol=1e-4, atol=1e-4)
        x = torch.randn(few, 576)
        assert torch.equal(cpu(x), native_kernels.small_gemm(x, cpu.small_packed, 960) + cpu.bias)
        x = torch.randn(16, 576)
        onednn = torch.ops.mkldnn._linear_pointwise(x, cpu.packed, cpu.bias, "none", [], "")
        assert torch.equal(cpu(x), onednn)
