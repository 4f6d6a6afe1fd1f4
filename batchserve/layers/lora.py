"""LoRA inside a projection: y += scale * (x @ A) @ B for each group of a step's tokens that share an adapter.

A projection that serves adapters holds a LoRASlots: per device slot, the A of each of its slices (a fused q/k/v
projection has three, gate/up two) stacked along the rank, and each slice's B. The step's grouping (LoRAStep) is an
argument: the model hands it to `project` with the input, nothing is read from ambient state. Per group: one shrink
(x_g @ A_s^T over every slice at once) and one expand per slice into that slice's output columns, scaled as PEFT does
after the expand. A fused projection's slices get their deltas before any fused activation (SwiGLU reads the sum).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn


@dataclass(frozen=True)
class LoRAGroup:
    """The tokens of one adapter in a step: its slot, its rank and scale, the rows (packed token index)."""

    slot: int
    rank: int
    scale: float
    rows: torch.Tensor  # [n] int64, on the model's device
    start: int = -1  # rows == arange(start, start + n) when the tokens are contiguous (-1: they are not)


@dataclass(frozen=True)
class LoRAStep:
    """One step's grouping of tokens by adapter; base-model tokens are in no group."""

    groups: tuple[LoRAGroup, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.groups)


@dataclass
class LoRASlots:
    """One projection's adapter weights in `num_slots` device slots. slices: (out offset, out size) of each part of
    the fused output (q, k, v; gate, up; or one). `a[s, :n_slices * r]`: the slot's A rows, slice by slice (r each);
    `b[i][s, :r]`: slice i's B. present[s][i]: the slot's adapter targets slice i."""

    slices: tuple[tuple[int, int], ...]
    a: torch.Tensor  # [S, n_slices * R, in]
    b: list[torch.Tensor]  # per slice [S, R, size]
    present: list[list[bool]] = field(default_factory=list)

    @classmethod
    def allocate(cls, slices, in_features: int, num_slots: int, max_rank: int, dtype, device) -> LoRASlots:
        a = torch.zeros(num_slots, len(slices) * max_rank, in_features, dtype=dtype, device=device)
        b = [torch.zeros(num_slots, max_rank, size, dtype=dtype, device=device) for _, size in slices]
        return cls(tuple(slices), a, b, [[False] * len(slices) for _ in range(num_slots)])

    def load(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None], rank: int) -> None:
        """Slot `slot` takes an adapter's (A [r, in], B [size, r]) per slice (None: the slice is not targeted)."""
        for i, part in enumerate(parts):
            rows = self.a[slot, i * rank : (i + 1) * rank]
            if part is None:
                rows.zero_()
                self.present[slot][i] = False
                continue
            a, b = part
            rows.copy_(a, non_blocking=True)
            self.b[i][slot, :rank].copy_(b.t(), non_blocking=True)
            self.present[slot][i] = True

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        """y [T, out] += each group's scale * (x_g @ A^T) @ B, in place (y is the projection's fresh output)."""
        for group in step.groups:
            present = self.present[group.slot]
            if not any(present):
                continue
            r = group.rank
            xg = (
                x[group.start : group.start + group.rows.shape[0]]
                if group.start >= 0
                else x.index_select(0, group.rows)
            )
            shrunk = xg.to(self.a.dtype) @ self.a[group.slot, : len(self.slices) * r].t()
            for i, (offset, size) in enumerate(self.slices):
                if not present[i]:
                    continue
                delta = (shrunk[:, i * r : (i + 1) * r] @ self.b[i][group.slot, :r]).to(y.dtype)
                out = y[:, offset : offset + size]
                if group.start >= 0:
                    out[group.start : group.start + delta.shape[0]].add_(delta, alpha=group.scale)
                else:
                    out.index_add_(0, group.rows, delta, alpha=group.scale)
        return y


def slots_of(linear: nn.Module) -> LoRASlots | None:
    return getattr(linear, "lora_slots", None)


def project(linear: nn.Module, x: torch.Tensor, lora: LoRAStep | None) -> torch.Tensor:
    """linear(x), plus the step's adapters' deltas where the projection serves adapters and the step has any."""
    y = linear(x)
    slots = slots_of(linear) if lora else None
    return y if slots is None else slots.add_delta(x, y, lora)


def takes_adapters(linear: nn.Module, lora: LoRAStep | None) -> bool:
    """This step adds adapter deltas to this projection's output (a fused activation must then read the sum)."""
    return bool(lora) and slots_of(linear) is not None
