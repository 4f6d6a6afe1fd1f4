"""LoRA inside a projection: y += scale * (x @ A) @ B for each group of a step's tokens that share an adapter.

A projection that serves adapters holds a LoRASlots: per device slot, the A of each of its slices (a fused q/k/v
projection has three, gate/up two) stacked along the rank, and each slice's B. The step's grouping (LoRAStep) is an
argument: the model hands it to `project` with the input, nothing is read from ambient state. Per group: one shrink
(x_g @ A_s^T over every slice at once) and one expand per slice into that slice's output columns, scaled as PEFT does
after the expand. A fused projection's slices get their deltas before any fused activation (SwiGLU reads the sum).

On the CPU with the native kernels the deltas are the native LoRA kernel's (kernels/lora_tiles.h), which the
native decoder loop calls after each projection too, so both ways of running a step add the same deltas; the torch
code here (`torch_delta`) is the reference it is tested against and what runs elsewhere (a GPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn

from batchserve.layers import kernels


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
    # False: the torch code adds the deltas even where the native kernel would (the step then runs the Python layers):
    # benchmarks/lora.py's loop over requests, x @ A @ B by separate torch matmuls per request
    native_kernel: bool = True

    def __bool__(self) -> bool:
        return bool(self.groups)

    @functools.cached_property
    def native(self):
        """The grouping as the native kernels take it (a LoraBatch: every group's rows in one vector), made once a
        step on the kernel's path; None where the native kernels are not built or the rows are not on the CPU."""
        native = kernels.load() if self.native_kernel else None
        if native is None or not self.groups or any(g.rows.device.type != "cpu" for g in self.groups):
            return None
        offsets = [0]
        for group in self.groups:
            offsets.append(offsets[-1] + group.rows.shape[0])
        rows = torch.cat([group.rows for group in self.groups])
        slots, ranks = [g.slot for g in self.groups], [g.rank for g in self.groups]
        scales, path = [g.scale for g in self.groups], kernels.lora_path()
        return native.LoraBatch(slots, ranks, scales, rows, offsets, path)


@dataclass
class LoRASlots:
    """One projection's adapter weights in `num_slots` device slots. slices: (out offset, out size) of each part of
    the fused output (q, k, v; gate, up; or one). For a slot whose adapter has rank r, `a[s, :n * r]` holds the A
    of each slice, slice by slice (r rows each): one shrink serves every slice. `b[s]` holds each slice's B^T
    [r, size] packed (kernels/lora_args.h): its columns cut into panels of PANEL, the last padded with zeros, each
    panel's r rows one after the other, slice after slice; so the native expand of a few columns reads one
    contiguous run. present[s]: the slot's adapter targets some slice of this projection."""

    slices: tuple[tuple[int, int], ...]
    a: torch.Tensor  # [S, n_slices * R, in]
    b: torch.Tensor  # [S, R * sum of the slices' padded sizes], packed
    present: list[bool] = field(default_factory=list)
    present_flags: torch.Tensor | None = None  # present as uint8 [S] on the CPU, for the native kernel
    _native: object = field(default=None, repr=False)
    # (slot, slice, rank) -> that slice's B unpacked, for the torch code: made when a group first reads it, dropped
    # when the slot takes another adapter (so that a step's matmuls do not each copy B out of its panels first)
    _unpacked: dict = field(default_factory=dict, repr=False)

    @classmethod
    def allocate(cls, slices, in_features: int, num_slots: int, max_rank: int, dtype, device) -> LoRASlots:
        rows, packed = len(slices) * max_rank, sum(padded(size) for _, size in slices)
        a = torch.zeros(num_slots, rows, in_features, dtype=dtype, device=device)
        b = torch.zeros(num_slots, max_rank * packed, dtype=dtype, device=device)
        return cls(tuple(slices), a, b, [False] * num_slots, torch.zeros(num_slots, dtype=torch.uint8))

    def load(self, slot: int, parts: list[tuple[torch.Tensor, torch.Tensor] | None], rank: int) -> None:
        """Slot `slot` takes an adapter's (A [r, in], B [size, r]) per slice (None: the slice is not targeted)."""
        self.load_rows(slot, self.rows_of(parts, rank))

    def rows_of(self, parts: list[tuple[torch.Tensor, torch.Tensor] | None], rank: int):
        """An adapter's parts (as `load` takes them) in a slot's layout: (a [n * r, in], b [r * packed sizes]) in
        host memory, or None where it targets no slice. Made when the adapter is read (worker/lora_slots.py: off the
        engine loop), so that taking a slot is two copies."""
        if all(part is None for part in parts):
            return None
        n = len(self.slices)
        a = torch.zeros(n * rank, self.a.shape[2], dtype=self.a.dtype)
        b = torch.zeros(rank * sum(padded(size) for _, size in self.slices), dtype=self.b.dtype)
        for i, part in enumerate(parts):
            if part is not None:
                a[i * rank : (i + 1) * rank].copy_(part[0])
                self._b_panels(b, i, rank).copy_(pack(part[1].t(), PANEL))
        return a, b

    def _b_panels(self, flat: torch.Tensor, i: int, rank: int) -> torch.Tensor:
        """Slice i's packed B in a slot's values `flat` (rank r): a view [panels, r, PANEL]."""
        start = rank * sum(padded(size) for _, size in self.slices[:i])
        width = padded(self.slices[i][1])
        return flat[start : start + rank * width].view(width // PANEL, rank, PANEL)

    def b_of(self, slot: int, i: int, rank: int) -> torch.Tensor:
        """Slice i's B^T [r, size] in slot `slot` (rank r), unpacked: a copy."""
        panels = self._b_panels(self.b[slot], i, rank)
        return panels.permute(1, 0, 2).reshape(rank, -1)[:, : self.slices[i][1]]

    def load_rows(self, slot: int, rows: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """Slot `slot` takes `rows_of`'s result. Rows past the adapter's n * r keep an earlier adapter's values:
        a group of rank r reads only its first n * r."""
        if rows is not None:
            self.a[slot, : rows[0].shape[0]].copy_(rows[0], non_blocking=True)
            self.b[slot, : rows[1].shape[0]].copy_(rows[1], non_blocking=True)
        self._unpacked = {key: b for key, b in self._unpacked.items() if key[0] != slot}
        self.present[slot] = rows is not None
        self.present_flags[slot] = int(rows is not None)

    def native_weights(self):
        """These slots as the native kernels take them (a LoraWeights sharing the tensors, made once); None where the
        native kernels do not take them (not built, not on the CPU, a dtype other than float32 or bfloat16)."""
        if self._native is None:
            native = kernels.for_tensors(self.a, self.b, dtypes=kernels.FUSED_DTYPES)
            if native is None:
                return None
            self._native = native.LoraWeights(self.a, self.b, self.present_flags, list(self.slices))
        return self._native

    def add_delta(self, x: torch.Tensor, y: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        """y [T, out] += each group's scale * (x_g @ A^T) @ B, in place (y is the projection's fresh output): the
        native kernel where it takes them, else the torch code."""
        weights, batch = self.native_weights(), step.native
        same_dtype = x.dtype == y.dtype == self.a.dtype
        if weights is not None and batch is not None and same_dtype and x.stride(-1) == y.stride(-1) == 1:
            kernels.load().lora_add_(x, y, weights, batch)
            return y
        return self.torch_delta(x, y, step)

    def torch_delta(self, x: torch.Tensor, y: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        """add_delta in torch: the reference of the native kernel, and the code that runs on a GPU."""
        for group in step.groups:
            if not self.present[group.slot]:
                continue
            r, a = group.rank, self.a[group.slot, : len(self.slices) * group.rank]
            end = group.start + group.rows.shape[0]
            contiguous = group.start >= 0  # the group's tokens are one run: y's rows are a slice of it
            u = (x[group.start : end] if contiguous else x.index_select(0, group.rows)).to(a.dtype) @ a.t()
            for i, (offset, size) in enumerate(self.slices):
                b, out = self._unpacked_b(group.slot, i, r), y[:, offset : offset + size]
                if contiguous:
                    out[group.start : end].addmm_(u[:, i * r : (i + 1) * r], b, alpha=group.scale)
                else:
                    delta = u[:, i * r : (i + 1) * r] @ b
                    out.index_add_(0, group.rows, delta.to(y.dtype), alpha=group.scale)
        return y

    def _unpacked_b(self, slot: int, i: int, rank: int) -> torch.Tensor:
        key = (slot, i, rank)
        if key not in self._unpacked:
            self._unpacked[key] = self.b_of(slot, i, rank)
        return self._unpacked[key]


PANEL = 16  # the packed B's panel width: kernels/lora_args.h's kLoraPanel (make_lora_weights checks the sizes)


def padded(size: int) -> int:
    """A slice's width in the packed B: whole panels."""
    return -(-size // PANEL) * PANEL


def pack(b_t: torch.Tensor, panel: int) -> torch.Tensor:
    """B^T [r, size] as [panels, r, panel]: columns cut into panels, the last padded with zeros."""
    rank, size = b_t.shape
    wide = torch.zeros(rank, padded(size), dtype=b_t.dtype)
    wide[:, :size].copy_(b_t)
    return wide.view(rank, -1, panel).permute(1, 0, 2)


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
