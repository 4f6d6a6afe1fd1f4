"""CPU tensors on 2 MiB pages (batchserve/host/huge_pages.py): aligned, advised, zeroed, unmapped with their last
tensor; an ordinary tensor, logged once, where the host cannot; the arena packs small tensors side by side."""

from __future__ import annotations

import gc
import logging

import pytest
import torch

from batchserve.host import huge_pages
from batchserve.host.huge_pages import HUGE_PAGE_BYTES, HugePageArena, on_huge_pages

needs_thp = pytest.mark.usefixtures("huge_pages_on")
LARGE = (4, 1 << 19)  # 8 MiB of bfloat16


def _mapping_of(tensor: torch.Tensor) -> str | None:
    """The address range of the mapping that holds `tensor`'s memory (/proc/self/maps), None where none does."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as f:
        for line in f:
            start, end = (int(x, 16) for x in line.split()[0].split("-"))
            if start <= address < end:
                return line.split()[0]
    return None


def _mapped_ranges() -> set[str]:
    with open("/proc/self/maps") as f:
        return {line.split()[0] for line in f}


@needs_thp
def test_a_large_tensor_starts_on_a_huge_page_zeroed_and_advised():
    t = huge_pages.zeros(LARGE, torch.bfloat16)
    assert t.shape == LARGE and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert t.data_ptr() % HUGE_PAGE_BYTES == 0
    assert not t.any()
    assert on_huge_pages(t)
    t[-1, -1] = 3.0  # writable to its last element
    assert t.sum().item() == 3.0


def test_a_small_tensor_stays_an_ordinary_one():
    t = huge_pages.zeros((16, 16), torch.float32)
    assert not t.any() and t.untyped_storage().resizable()  # torch's own, not a view of a mapping


@needs_thp
def test_the_mapping_goes_with_its_last_view():
    t = huge_pages.zeros(LARGE, torch.float32)
    view = t[1]
    del t
    gc.collect()
    assert on_huge_pages(view)
    mapping = _mapping_of(view)
    del view
    gc.collect()
    # its own range, not a count of all of them: the C heap's mappings come and go with the rest of the process
    assert mapping is not None and mapping not in _mapped_ranges()


def test_without_huge_pages_it_is_torch_zeros_and_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(huge_pages, "huge_pages_unavailable", lambda: "transparent huge pages are off ([never])")
    monkeypatch.setattr(huge_pages, "_logged", set())
    with caplog.at_level(logging.INFO, logger=huge_pages.__name__):
        tensors = [huge_pages.zeros(LARGE, torch.bfloat16) for _ in range(3)]
        copy = HugePageArena().copy(torch.ones(8, 8))
    # torch's own tensors: their storage is torch's to resize, which a view of a mapping's bytes is not (whether the
    # C heap under them was advised huge pages is the allocator's business, and earlier work in the process may have)
    assert all(not t.any() and t.untyped_storage().resizable() for t in tensors)
    assert torch.equal(copy, torch.ones(8, 8))
    assert [r.getMessage() for r in caplog.records].count(
        "large tensors stay on ordinary pages: transparent huge pages are off ([never])"
    ) == 1


@needs_thp
def test_the_arena_copies_small_tensors_side_by_side_and_lets_go_of_a_freed_chunk():
    arena = HugePageArena(chunk_bytes=4 * HUGE_PAGE_BYTES)
    sources = [torch.randn(33, 7).bfloat16() for _ in range(5)] + [torch.randn(8, 3).t()]  # the last not contiguous
    copies = [arena.copy(s) for s in sources]
    for source, copy in zip(sources, copies, strict=True):
        assert torch.equal(copy, source) and copy.is_contiguous() and copy.data_ptr() % 64 == 0
        assert on_huge_pages(copy)
    assert copies[0].data_ptr() % HUGE_PAGE_BYTES == 0
    assert copies[1].data_ptr() - copies[0].data_ptr() == 512  # 462 bytes, rounded up to 64
    copies[0].fill_(1.0)
    assert torch.equal(copies[1], sources[1])  # neighbours do not overlap
    chunk = arena._chunk
    del copies, copy
    gc.collect()
    assert chunk() is None


@needs_thp
def test_the_arena_gives_a_large_tensor_a_mapping_of_its_own():
    arena = HugePageArena(chunk_bytes=4 * HUGE_PAGE_BYTES)
    small = arena.copy(torch.ones(4))
    large = arena.copy(torch.ones(HUGE_PAGE_BYTES // 2))  # 4 MiB: over a quarter of a chunk
    assert large.data_ptr() % HUGE_PAGE_BYTES == 0 and on_huge_pages(large)
    assert arena.copy(torch.ones(4)).data_ptr() - small.data_ptr() == 64  # the chunk goes on after the large one


def test_batchserve_huge_pages_0_keeps_large_tensors_on_ordinary_pages(monkeypatch, caplog):
    monkeypatch.setenv("BATCHSERVE_HUGE_PAGES", "0")
    monkeypatch.setattr(huge_pages, "_logged", set())
    with caplog.at_level(logging.INFO, logger=huge_pages.__name__):
        t = huge_pages.zeros(LARGE, torch.bfloat16)
        copy = HugePageArena().copy(torch.ones(8, 8))
    assert not t.any() and t.untyped_storage().resizable() and copy.untyped_storage().resizable()  # torch's own
    assert "BATCHSERVE_HUGE_PAGES=0" in caplog.text


def test_placing_a_fresh_tensor_copies_it_onto_huge_pages_or_keeps_it_as_it_is(monkeypatch):
    """`place` (a layout its caller just made): on huge pages where the host allows, as `copy` puts it; where not, the
    same tensor, not a clone, made contiguous only where it was not."""
    fresh, transposed = torch.randn(33, 7), torch.randn(8, 3).t()
    monkeypatch.setenv("BATCHSERVE_HUGE_PAGES", "0")
    kept = HugePageArena().place(fresh)
    assert kept is fresh
    made_contiguous = HugePageArena().place(transposed)
    assert made_contiguous.is_contiguous() and torch.equal(made_contiguous, transposed)
    if huge_pages.host_cannot() is not None:
        return
    monkeypatch.setenv("BATCHSERVE_HUGE_PAGES", "1")
    placed = HugePageArena(chunk_bytes=4 * HUGE_PAGE_BYTES).place(fresh)
    assert placed.data_ptr() != fresh.data_ptr() and torch.equal(placed, fresh) and on_huge_pages(placed)
