"""The native LoRA kernel (kernels/lora_tiles.h, through LoRASlots.add_delta) against the torch code it stands in
for (LoRASlots.torch_delta), on every path this host runs, float32 and bfloat16: fused projections of slices of
different widths, groups of contiguous and of scattered rows, ranks below the slots' maximum, a slot whose adapter
does not target the projection, input widths that are no multiple of a vector, slices whose packed B ends in a
padded panel. The slots' packed B gives back what was loaded, panels padded with zeros. And its checks: rows beyond x, a
slot beyond the slots, or tensors of another projection are errors naming what is wrong."""

from __future__ import annotations

import pytest
import torch

from batchserve.layers import kernels
from batchserve.layers.lora import LoRAGroup, LoRASlots, LoRAStep

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="native kernels not built here")

SLICES = ((0, 40), (40, 24), (64, 24))  # q, k, v of a small fused projection
IN = 52  # no multiple of 8 or 16: every row ends in a short chunk
MAX_RANK = 8


def filled_slots(dtype: torch.dtype, seed: int) -> LoRASlots:
    """Four slots: rank 8 on every slice, rank 4 on q and v only, rank 2 on k only, and one targeting nothing."""
    g = torch.Generator().manual_seed(seed)
    slots = LoRASlots.allocate(SLICES, IN, 4, MAX_RANK, dtype, torch.device("cpu"))
    for slot, (rank, targeted) in enumerate([(8, (0, 1, 2)), (4, (0, 2)), (2, (1,)), (8, ())]):
        parts = [(torch.randn(rank, IN, generator=g), torch.randn(size, rank, generator=g)) if i in targeted else None
                 for i, (_, size) in enumerate(SLICES)]  # fmt: skip
        slots.load(slot, parts, rank)
    return slots


def group(slot: int, rank: int, scale: float, rows: list[int]) -> LoRAGroup:
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    return LoRAGroup(slot, rank, scale, torch.tensor(rows, dtype=torch.int64), rows[0] if contiguous else -1)


def a_step() -> LoRAStep:
    """23 rows: two scattered groups (one of them longer than a tile), a contiguous one, one whose adapter targets
    nothing here; rows 3, 4 and 22 run the base model."""
    return LoRAStep((
        group(0, 8, 0.5, [0, 2, 5, 6, 7, 8, 9, 20]),
        group(1, 4, 2.0, [1, 10, 11]),
        group(2, 2, 1.0, list(range(12, 20))),
        group(3, 8, 1.0, [21]),
    ))  # fmt: skip


def reference_deltas(slots: LoRASlots, x: torch.Tensor, y: torch.Tensor, step: LoRAStep, path: str) -> torch.Tensor:
    """The torch code's deltas in float64; on the avx512_bf16 path with bfloat16 slots each row's shrink rounded to
    bfloat16 first, as that path's pair expand takes it (and as the torch code's bfloat16 shrink is rounded)."""
    in_double = LoRASlots(slots.slices, slots.a.double(), slots.b.double(), list(slots.present))
    if path != "avx512_bf16" or slots.a.dtype != torch.bfloat16:
        return in_double.torch_delta(x.double(), y.double(), step)
    out = y.double()
    for each in step.groups:
        if not slots.present[each.slot]:
            continue
        rank, rows = each.rank, each.rows
        u = (x[rows].double() @ in_double.a[each.slot, : len(slots.slices) * rank].t()).bfloat16().double()
        for i, (offset, size) in enumerate(slots.slices):
            b = in_double.b_of(each.slot, i, rank)
            out[rows, offset : offset + size] += each.scale * (u[:, i * rank : (i + 1) * rank] @ b)
    return out


@pytest.mark.parametrize("path", ["avx512_bf16", "avx512", "avx2", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_adds_the_torch_codes_deltas(force_lora_path, path, dtype):
    force_lora_path(path)
    slots = filled_slots(dtype, seed=1)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(23, IN, generator=g).to(dtype)
    y = torch.randn(23, 88, generator=g).to(dtype)
    step = a_step()
    assert step.native is not None and step.native is step.native  # made once a step
    native = slots.add_delta(x, y.clone(), step)
    reference = reference_deltas(slots, x, y, step, path)
    # float32 sums of at most 52 products; bfloat16: one rounding of y's sum (relative 2^-8) on either side
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=6e-2)
    torch.testing.assert_close(native.double(), reference, **tolerance)
    changed = (native != y).any(dim=1)
    assert changed[[0, 1, 2, 5, 10, 12, 19, 20]].all()  # every adapter that targets a slice moved its rows
    assert not changed[[3, 4, 21, 22]].any()  # base rows, and the adapter that targets nothing here


def test_the_packed_b_gives_back_each_slices_weights():
    """Each slice's B, as loaded, from its panels (layers/lora.py LoRASlots.b_of), for ranks under the maximum; the
    padding of a slice's last panel is zeros and nothing past an adapter's values is written."""
    g = torch.Generator().manual_seed(5)
    slots = LoRASlots.allocate(SLICES, IN, 2, MAX_RANK, torch.float32, torch.device("cpu"))
    assert slots.b.shape == (2, MAX_RANK * (48 + 32 + 32))  # 40 and 24 wide: 3 and 2 panels of 16
    slots.b.fill_(7.0)
    parts = [(torch.randn(4, IN, generator=g), torch.randn(size, 4, generator=g)) for _, size in SLICES]
    slots.load(1, parts, 4)
    for i in range(len(SLICES)):
        torch.testing.assert_close(slots.b_of(1, i, 4), parts[i][1].t(), rtol=0, atol=0)
    packed = slots.b[1, : 4 * (48 + 32 + 32)].view(-1, 4, 16)  # every panel of the three slices, in order
    assert (packed[2, :, 8:] == 0).all() and (packed[4, :, 8:] == 0).all() and (packed[6, :, 8:] == 0).all()
    assert (slots.b[1, 4 * (48 + 32 + 32) :] == 7.0).all() and (slots.b[0] == 7.0).all()


def test_every_path_agrees_within_rounding(force_lora_path):
    """The paths sum in other orders: float32 results within a few ulps of each other."""
    slots = filled_slots(torch.float32, seed=3)
    g = torch.Generator().manual_seed(4)
    x, y = torch.randn(23, IN, generator=g), torch.randn(23, 88, generator=g)
    results = []
    for path in ("avx512_bf16", "avx512", "avx2", "portable"):
        if kernels.lora_path_runs(path):
            force_lora_path(path)
            results.append(slots.add_delta(x, y.clone(), a_step()))
    for other in results[1:]:
        torch.testing.assert_close(other, results[0], rtol=1e-5, atol=1e-4)  # sums near 0 of terms near 40


def test_bad_arguments_are_errors_that_say_what_is_wrong():
    native = kernels.load()
    slots = filled_slots(torch.float32, seed=4)
    weights = slots.native_weights()
    x, y = torch.randn(5, IN), torch.randn(5, 88)
    with pytest.raises(RuntimeError, match="covering the groups' rows"):
        native.lora_add_(x, y, weights, LoRAStep((group(0, 8, 1.0, [3, 9]),)).native)
    with pytest.raises(RuntimeError, match="beyond the slots"):
        native.lora_add_(x, y, weights, LoRAStep((group(7, 8, 1.0, [1]),)).native)
    with pytest.raises(RuntimeError, match="beyond the slots"):
        native.lora_add_(x, y, weights, LoRAStep((group(0, 16, 1.0, [1]),)).native)
    with pytest.raises(RuntimeError, match="another projection"):
        native.lora_add_(x, torch.randn(5, 90), weights, LoRAStep((group(0, 8, 1.0, [1]),)).native)
    with pytest.raises(RuntimeError, match="one dtype"):
        native.lora_add_(x.bfloat16(), y.bfloat16(), weights, LoRAStep((group(0, 8, 1.0, [1]),)).native)
    with pytest.raises(ValueError, match="offsets"):
        native.LoraBatch([0], [8], [1.0], torch.tensor([1]), [0, 2], kernels.lora_path())


@pytest.mark.parametrize("path", ["avx512_bf16", "avx512", "avx2", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_tile_height_gives_each_row_what_it_gets_alone(force_lora_path, path, dtype):
    """Groups of 1 to 8 rows (one tile of each height) and of 11 (a full tile and a short one), scattered: each row's
    delta is the one it gets in a group of its own, bit for bit on the vector paths (a row's sums never depend on its
    tile), and the torch code's within rounding."""
    force_lora_path(path)
    slots = filled_slots(dtype, seed=5)
    sizes = list(range(1, 9)) + [11]
    order = torch.randperm(sum(sizes), generator=torch.Generator().manual_seed(6)).tolist()
    groups, start = [], 0
    for i, size in enumerate(sizes):
        slot, rank = [(0, 8), (1, 4), (2, 2)][i % 3]
        groups.append(group(slot, rank, 0.5 + i, order[start : start + size]))
        start += size
    g = torch.Generator().manual_seed(7)
    x = torch.randn(start, IN, generator=g).to(dtype)
    y = torch.randn(start, 88, generator=g).to(dtype)
    together = slots.add_delta(x, y.clone(), LoRAStep(tuple(groups)))
    alone = y.clone()
    for each in groups:
        for row in each.rows.tolist():
            slots.add_delta(x, alone, LoRAStep((group(each.slot, each.rank, each.scale, [row]),)))
    if path == "portable":  # plain C++ under -ffast-math: the compiler orders a sum as it likes, height by height
        torch.testing.assert_close(together, alone, rtol=1e-5, atol=1e-4)
    else:
        assert torch.equal(together, alone)
    reference = reference_deltas(slots, x, y, LoRAStep(tuple(groups)), path)
    tolerance = dict(rtol=1e-5, atol=1e-4) if dtype == torch.float32 else dict(rtol=1.6e-2, atol=6e-2)
    torch.testing.assert_close(together.double(), reference, **tolerance)
    assert (together != y).any(dim=1).all()  # every row's adapter targets some slice here
