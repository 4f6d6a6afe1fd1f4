"""The torch code of the LoRA deltas (layers/lora.py LoRASlots.torch_delta) keeps each slot's B unpacked between steps:
a slot that takes another adapter must be read afresh, never with the B of the adapter it held before."""

from __future__ import annotations

import torch

from batchserve.layers.lora import LoRAGroup, LoRASlots, LoRAStep

SLICES = ((0, 20), (20, 36))  # gate, up of a small fused projection (36: a padded last panel)
IN = 12


def parts(seed: int, rank: int):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(rank, IN, generator=g), torch.randn(size, rank, generator=g)) for _, size in SLICES]


def test_a_slot_reloaded_adds_its_new_adapters_deltas():
    step = LoRAStep((LoRAGroup(0, 4, 0.5, torch.arange(0, 3), 0),))
    x = torch.randn(3, IN, generator=torch.Generator().manual_seed(9))
    slots = LoRASlots.allocate(SLICES, IN, 2, 4, torch.float32, torch.device("cpu"))
    slots.load(0, parts(1, 4), 4)
    first = slots.torch_delta(x, torch.zeros(3, 56), step)
    slots.load(0, parts(2, 4), 4)  # the same slot, another adapter of the same rank
    second = slots.torch_delta(x, torch.zeros(3, 56), step)
    fresh = LoRASlots.allocate(SLICES, IN, 2, 4, torch.float32, torch.device("cpu"))
    fresh.load(0, parts(2, 4), 4)
    assert torch.equal(second, fresh.torch_delta(x, torch.zeros(3, 56), step))
    assert not torch.equal(first, second)
    a, b = parts(2, 4)[1]  # and what it adds is x @ A^T @ B^T, scaled, per slice
    torch.testing.assert_close(second[:, 20:], 0.5 * (x @ a.t()) @ b.t())
