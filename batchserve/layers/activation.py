"""The GeGLU MLP (Gemma): one gate/up projection, gelu(gate, tanh approximation) * up, the down projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from batchserve.layers.lora import LoRAStep, project
from batchserve.layers.mlp import MLP
from batchserve.layers.op_plan import Op, OpKind


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[M, 2I] (gate columns, then up columns) -> gelu_tanh(gate) * up [M, I]: transformers' gelu_pytorch_tanh."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh") * up


class GeGLUMLP(MLP):
    """The MLP's projections and weight layout; only the activation differs. Its gate/up projection must keep the
    plain [gate rows; up rows] layout on the CPU (CpuLinear without swiglu=True), since no native kernel fuses GELU."""

    swiglu = False

    def op(self) -> Op:
        return Op(OpKind.GEGLU_MLP, linears=(self.gate_up_proj, self.down_proj))

    def forward(self, x: torch.Tensor, lora: LoRAStep | None = None) -> torch.Tensor:
        return project(self.down_proj, gelu_tanh_and_mul(project(self.gate_up_proj, x, lora)), lora)
