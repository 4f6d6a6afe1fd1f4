"""RMSNorm with the residual add fused in, one Triton program a row: a candidate for the GPU's elementwise work,
not wired into the layers until a GPU measures it against torch's (benchmarks/gpu_check.py, "fused_norm").
"""

from __future__ import annotations

import torch

from batchserve.layers.gpu.paged_attention import jitted


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """As layers/norm.py RMSNorm for x [T, hidden]: norm(x), or with a residual (norm(x + residual), x + residual),
    the sum written into `residual` in place."""
    if x.dim() != 2 or x.stride(1) != 1 or (residual is not None and residual.stride(1) != 1):
        raise ValueError("rms_norm takes rows of contiguous hidden states")
    num_rows, hidden = x.shape
    out = torch.empty_like(x)
    res = residual if residual is not None else x
    jitted("rms_norm_residual")[(num_rows,)](
        x, res, weight, out, eps, x.stride(0), res.stride(0), out.stride(0), hidden,
        BLOCK=1 << (hidden - 1).bit_length(), HAS_RESIDUAL=residual is not None,
        num_warps=8 if hidden >= 2048 else 4,
    )  # fmt: skip
    return out if residual is None else (out, residual)
