"""RMSNorm, with the residual add fused in."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchserve.layers import kernels


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float, dtype: torch.dtype | None = None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x), or with a residual: (norm(x + residual), x + residual), the sum being the next residual stream.
        The native kernel does either in one pass (the sum in place in `residual`)."""
        native = kernels.for_tensors(x, self.weight, dtypes=kernels.FUSED_DTYPES)
        if native is not None and x.dim() == 2 and x.stride(1) == 1:
            out = native.rms_norm(x, residual, self.weight, self.eps)
            return out if residual is None else (out, residual)
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)
