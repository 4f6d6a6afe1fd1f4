"""The op plan: each decoder layer as the list of operations it runs, built from the model's modules (each module
says which ops it is: `DecoderLayer.ops()`, `Attention.ops()`, an MLP's `op()`), and handed once to the native decoder
loop (kernels/decoder_loop.cpp), which runs those ops in that order with the same operators the Python layers call.

A module's feature inserts or changes an op: a q/k norm inserts QK_NORM, partial rotary is ROPE over fewer dims, a
sliding window or soft-capped scores are arguments of ATTENTION, sandwich norms insert NORMs, GeGLU and MoE replace
the SwiGLU MLP op. The model's capabilities (layers/capabilities.py) are read off its plan (`capabilities`), so a
feature is declared in one place, the module that computes it.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from batchserve.layers.capabilities import Capability
from batchserve.layers.lora import slots_of

logger = logging.getLogger(__name__)


class OpKind(str, enum.Enum):
    """What one op does to the layer's values (h: the sublayer's input/output; residual: the stream), and its
    arguments as exported (tensors; linears; ints; floats). kernels/decoder_loop.cpp kOpKinds is this list."""

    RESIDUAL_NORM = "residual_norm"  # h, residual = norm(h + residual) (first layer: residual = h); weight; eps
    NORM = "norm"  # h = norm(h): a sandwich norm after a sublayer; weight; eps
    QKV = "qkv"  # q/k heads and v of one projection of h; qkv; heads, kv heads, head size
    QK_NORM = "qk_norm"  # RMSNorm of each q and k head; q, k weights; heads, kv heads, head size; eps
    ROPE = "rope"  # rotary on q and k heads' first dims; table index, rotary dims, head size
    ATTENTION = "attention"  # paged attention -> h; heads, kv heads, head size, window, query tile; scale, softcap
    O_PROJ = "o_proj"  # h = o(h); o
    SWIGLU_MLP = "swiglu_mlp"  # h = down(silu(gate) * up); gate/up, down
    GEGLU_MLP = "geglu_mlp"  # h = down(gelu_tanh(gate) * up); gate/up, down
    MOE_MLP = "moe_mlp"  # the top-k experts' SwiGLU; router; each expert's gate/up, down; top k, normalize


@dataclass(frozen=True)
class Op:
    """One op of a layer's plan. A window or soft-cap of 0 means none (as the native loop reads them)."""

    kind: OpKind
    tensors: tuple[torch.Tensor, ...] = ()
    linears: tuple[nn.Module, ...] = ()  # projections: CpuLinear (a native Projection) once laid out for the CPU
    ints: tuple[int, ...] = ()
    floats: tuple[float, ...] = ()

    def export(self, module) -> tuple:
        """(kind, tensors, projections, ints, floats, loras) as DecoderLoop.add_layer of the native module `module`
        takes it (loras: each projection's adapter slots, layers/lora.py, or none); raises ValueError where a
        projection has no native layout or its adapter slots are not ones the native kernels take."""
        natives = [getattr(linear, "native", None) for linear in self.linears]
        if self.kind == OpKind.MOE_MLP and not natives:
            raise ValueError("an MoE MLP without its experts' CPU layouts")
        if any(native is None for native in natives):
            raise ValueError(f"op {self.kind.value}: a projection without a native layout")
        tensors = [t.detach() for t in self.tensors]
        return self.kind.value, tensors, natives, list(self.ints), list(self.floats), self._loras(module)

    def _loras(self, module) -> list:
        slots = [slots_of(linear) for linear in self.linears]
        if all(s is None for s in slots):
            return []
        weights = [module.LoraWeights() if s is None else s.native_weights() for s in slots]
        if any(w is None for w in weights):
            raise ValueError(f"op {self.kind.value}: adapter slots the native LoRA kernel does not take")
        return weights

    def takes_adapters(self) -> bool:
        """Some projection of this op has adapter slots (layers/lora.py)."""
        return any(slots_of(linear) is not None for linear in self.linears)


LayerPlan = list[Op]


def norm_op(kind: OpKind, norm: nn.Module) -> Op:
    return Op(kind, tensors=(norm.weight,), floats=(norm.eps,))


def capabilities(plan: Sequence[LayerPlan], model_level: Iterable[Capability] = ()) -> frozenset[Capability]:
    """What a model computes, read off its plan, plus what it computes outside the layers (`model_level`: tied
    embeddings, soft-capped logits)."""
    found = set(model_level)
    for layer in plan:
        for op in layer:
            found |= _op_capabilities(op)
    return frozenset(found)


def _op_capabilities(op: Op) -> set[Capability]:
    kind = op.kind
    if kind in (OpKind.RESIDUAL_NORM, OpKind.NORM):
        return {Capability.RMS_NORM} | ({Capability.SANDWICH_NORM} if kind == OpKind.NORM else set())
    if kind == OpKind.QKV:
        heads, kv_heads, _ = op.ints
        return ({Capability.GQA} if kv_heads < heads else set()) | _bias(op, Capability.QKV_BIAS)
    if kind == OpKind.O_PROJ:
        return _bias(op, Capability.O_BIAS)
    if kind == OpKind.ROPE:
        _, rotary_dims, head_dim = op.ints
        return {Capability.ROPE} | ({Capability.PARTIAL_ROTARY} if rotary_dims < head_dim else set())
    if kind == OpKind.ATTENTION:
        window, softcap = op.ints[3], op.floats[1]
        return ({Capability.SLIDING_WINDOW} if window else set()) | ({Capability.SOFTCAP} if softcap else set())
    single = {OpKind.QK_NORM: Capability.QK_NORM, OpKind.SWIGLU_MLP: Capability.SWIGLU,
              OpKind.GEGLU_MLP: Capability.GEGLU, OpKind.MOE_MLP: Capability.MOE}  # fmt: skip
    return {single[kind]}


def _bias(op: Op, capability: Capability) -> set[Capability]:
    return {capability} if getattr(op.linears[0], "bias", None) is not None else set()


def native_op_kinds(native) -> set[str]:
    """The op kinds the native loop of the module `native` runs."""
    return set(native.DecoderLoop.op_kinds())


def native_loop(native, plan: Sequence[LayerPlan]):
    """The plan as a native DecoderLoop, or None where the loop lacks one of its op kinds or a projection has no native
    layout (logged: the Python layers run)."""
    lacking = sorted({op.kind.value for layer in plan for op in layer} - native_op_kinds(native))
    if lacking:
        logger.info("native decoder loop: off, it does not implement %s; the Python layers run", ", ".join(lacking))
        return None
    loop = native.DecoderLoop()
    try:
        for layer in plan:
            loop.add_layer([op.export(native) for op in layer])
    except ValueError as refusal:
        logger.info("native decoder loop: off, %s; the Python layers run", refusal)
        return None
    return loop
