"""The fused RMSNorm + residual Triton kernel (layers/gpu/fused_norm.py) under Triton's interpreter, on the CPU,
against layers/norm.py's torch code: with and without a residual, float32 / bfloat16 / float16, a hidden size that is
not a power of two."""

from __future__ import annotations

import os
import sys

# The interpreter must be chosen before Triton is first imported (see test_triton_attention.py).
if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from batchserve.layers import kernels
from batchserve.layers.gpu import fused_norm
from batchserve.layers.gpu import paged_attention as gpu
from batchserve.layers.norm import RMSNorm

pytestmark = [
    pytest.mark.skipif(not gpu.available(), reason="triton is not importable"),
    pytest.mark.skipif(
        gpu.available() and not gpu.interpreting(), reason="triton was imported before the interpreter was chosen"
    ),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("hidden", [64, 576])
def test_fused_rms_norm_matches_the_torch_code(dtype, hidden, monkeypatch):
    monkeypatch.setattr(kernels, "for_tensors", lambda *tensors, dtypes=None: None)  # the torch code as reference
    torch.manual_seed(hidden)
    norm = RMSNorm(hidden, 1e-5, dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    x, residual = (torch.randn(5, hidden).to(dtype) for _ in range(2))
    expected_out, expected_residual = norm(x, residual.clone())
    fused_residual = residual.clone()
    out, returned = fused_norm.rms_norm(x, norm.weight.detach(), 1e-5, fused_residual)
    assert returned is fused_residual  # the sum is written in place, as the native kernel does
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    # one rounding of the same sum; the interpreter rounds float32 to bfloat16 its own way (within a bfloat16 step)
    exact = dict(atol=0, rtol=0) if dtype != torch.bfloat16 else dict(atol=0, rtol=2**-7)
    torch.testing.assert_close(fused_residual, expected_residual, **exact)
    torch.testing.assert_close(out, expected_out, **tol)
    torch.testing.assert_close(fused_norm.rms_norm(x, norm.weight.detach(), 1e-5), norm(x), **tol)
