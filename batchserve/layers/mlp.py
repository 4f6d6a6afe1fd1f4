"""The SwiGLU MLP: one gate/up projection, silu(gate) * up, the down projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchserve.config import ModelConfig
from batchserve.layers import kernels
from batchserve.layers.linear import CpuLinear
from batchserve.layers.lora import LoRAStep, project, takes_adapters
from batchserve.layers.op_plan import Op, OpKind


class MLP(nn.Module):
    swiglu = True  # gate/up read through silu_and_mul: CpuLinear may interleave its gate and up panels

    def __init__(self, config: ModelConfig, dtype: torch.dtype | None = None):
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, dtype=dtype)

    def op(self) -> Op:
        """This MLP as an op of the layer's plan (layers/op_plan.py)."""
        return Op(OpKind.SWIGLU_MLP, linears=(self.gate_up_proj, self.down_proj))

    def forward(self, x: torch.Tensor, lora: LoRAStep | None = None) -> torch.Tensor:
        if takes_adapters(self.gate_up_proj, lora):  # the deltas join gate and up before SwiGLU reads them
            h = self._silu_and_mul(project(self.gate_up_proj, x, lora))
        elif self._native_pair(x, lora):  # the native decoder loop's call: row tiles where gate/up is AMX-fused
            return kernels.load().swiglu_mlp(x, self.gate_up_proj.native, self.down_proj.native)
        elif isinstance(self.gate_up_proj, CpuLinear):  # the native Projection's silu_and_mul (AMX-fused where it can)
            h = self.gate_up_proj.silu_and_mul(x)
        else:
            h = self._silu_and_mul(self.gate_up_proj(x))
        return project(self.down_proj, h, lora)

    def _native_pair(self, x: torch.Tensor, lora: LoRAStep | None) -> bool:
        """Both projections are native Projections and neither serves adapters this step."""
        gate_up, down = self.gate_up_proj, self.down_proj
        return (
            isinstance(gate_up, CpuLinear)
            and gate_up.native is not None
            and getattr(down, "native", None) is not None
            and x.dtype in kernels.FUSED_DTYPES
            and not takes_adapters(down, lora)
        )

    @staticmethod
    def _silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
        native = kernels.for_tensors(gate_up, dtypes=kernels.FUSED_DTYPES)
        if native is not None and gate_up.stride(1) == 1:
            return native.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up
