"""A sparse mixture-of-experts MLP (Mixtral, Qwen3-MoE): a router scores each token against E SwiGLU experts, the
token goes through its top k, and their outputs are summed with the router's weights.

The experts run grouped: a step's (token, expert) pairs are sorted by expert, each active expert runs one gate/up GEMM
and one down GEMM over all the tokens routed to it (gathered into one block), and the weighted outputs are
scatter-added back to their tokens (index_add_). The cost follows the active experts, not the tokens; an expert no
token chose costs nothing. The weights are stacked ([E, 2I, H] gate rows then up rows, [E, H, I]), so a checkpoint's
per-expert tensors load into slices; on the CPU `use_cpu_linear_layouts` lays each expert out as CpuLinears (the
native GEMMs the dense MLP uses, picked by rows) and drops the stacked copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from batchserve.layers import kernels
from batchserve.layers.linear import CpuLinear
from batchserve.layers.op_plan import Op, OpKind


class Router(nn.Module):
    """Top-k routing: softmax over the E experts' logits in float32, the k largest, renormalised to sum 1 when
    `normalize` (Mixtral always; Qwen3-MoE's norm_topk_prob)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, normalize: bool, dtype=None):
        super().__init__()
        self.top_k, self.normalize = top_k, normalize
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] float32, expert ids [T, k])."""
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights, experts


class Experts(nn.Module):
    """E SwiGLU MLPs, stacked; named as transformers 5 names them (`experts.gate_up_proj`, `experts.down_proj`)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype=None):
        super().__init__()
        self.num_experts, self.intermediate_size = num_experts, intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size, dtype=dtype))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype))
        self.cpu_layouts: nn.ModuleList | None = None  # per expert (gate_up, down) CpuLinears, once laid out

    def use_cpu_linear_layouts(self) -> None:
        """Each expert's projections as CpuLinears; the stacked parameters are dropped (the layouts are copies)."""
        self.cpu_layouts = nn.ModuleList(
            nn.ModuleList((CpuLinear.from_linear(_as_linear(self.gate_up_proj[e]), swiglu=True),
                           CpuLinear.from_linear(_as_linear(self.down_proj[e]))))
            for e in range(self.num_experts)
        )  # fmt: skip
        self.gate_up_proj = self.down_proj = None

    def expert(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Expert `index` on its tokens x [M, H] -> [M, H]: one gate/up GEMM, silu(gate) * up, one down GEMM."""
        if self.cpu_layouts is not None:
            gate_up, down = self.cpu_layouts[index]
            return down(gate_up.silu_and_mul(x))
        gate_up = F.linear(x, self.gate_up_proj[index])
        native = kernels.for_tensors(gate_up, dtypes=kernels.FUSED_DTYPES)
        if native is not None:
            hidden = native.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = F.silu(gate) * up
        return F.linear(hidden, self.down_proj[index])


def _as_linear(weight: torch.Tensor) -> nn.Linear:
    """A bias-free Linear over `weight` [out, in] (what CpuLinear.from_linear takes), not copied."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta", dtype=weight.dtype)
    linear.weight = nn.Parameter(weight.detach(), requires_grad=False)
    return linear


class SparseMoE(nn.Module):
    """The MoE MLP: `gate` (the router) and `experts`, as the checkpoints name them."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        normalize_topk: bool,
        dtype: torch.dtype | None = None,
    ):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok {top_k} must be in [1, num_experts={num_experts}]")
        self.gate = Router(hidden_size, num_experts, top_k, normalize_topk, dtype)
        self.experts = Experts(num_experts, hidden_size, intermediate_size, dtype)

    def use_cpu_linear_layouts(self) -> None:
        self.experts.use_cpu_linear_layouts()

    def op(self) -> Op:
        """This block as an op of the layer's plan (layers/op_plan.py); its experts' projections once laid out for the
        CPU (each expert's gate/up, then down)."""
        layouts = self.experts.cpu_layouts or ()
        return Op(
            OpKind.MOE_MLP,
            tensors=(self.gate.weight,),
            linears=tuple(linear for pair in layouts for linear in pair),
            ints=(self.gate.top_k, int(self.gate.normalize)),
        )

    def forward(self, x: torch.Tensor, lora: object = None) -> torch.Tensor:
        """x [T, H] -> [T, H]: each token's top-k experts' outputs, weighted by the router, summed in float32.
        `lora`: the step's adapters, which no expert takes (modes.py refuses LoRA with an MoE model)."""
        weights, experts = self.gate(x)
        top_k = experts.shape[1]
        # (token, expert) pairs sorted by expert: each expert's tokens are one contiguous run
        order = torch.argsort(experts.reshape(-1), stable=True)
        tokens = order // top_k
        counts = torch.bincount(experts.reshape(-1), minlength=self.experts.num_experts).tolist()
        gathered = x.index_select(0, tokens)
        outputs = torch.empty_like(gathered)
        start = 0
        for index, count in enumerate(counts):
            if count:
                end = start + count
                outputs[start:end] = self.experts.expert(index, gathered[start:end])
                start = end
        weighted = outputs.float() * weights.reshape(-1).index_select(0, order).unsqueeze(1)
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, tokens, weighted).to(x.dtype)
