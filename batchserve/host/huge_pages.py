"""CPU tensors on 2 MiB pages: memory mapped on a 2 MiB boundary and advised MADV_HUGEPAGE, for what a decode step
streams once per step (the KV pool, the GEMM layouts of the weights). On 4 KiB pages such a read misses the TLB every
4 KiB; the host's transparent huge pages are often in `madvise` mode, where nothing gets 2 MiB pages unless asked.
Where it cannot be done (not Linux, THP `never`, a GPU tensor, a small tensor) the tensor is an ordinary one, and
the reason is logged once. The memory is anonymous and mapped apart from the C heap: the kernel hands it over zeroed
page by page at first touch and takes it back when the last tensor on it is freed."""

from __future__ import annotations

import functools
import logging
import mmap
import threading
import weakref
from pathlib import Path

import torch

from batchserve import env

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
# Below this a tensor of its own stays on ordinary pages: it would hold a whole 2 MiB page for a few bytes. Many
# smaller tensors share mappings through a HugePageArena instead.
MIN_OWN_MAPPING_BYTES = HUGE_PAGE_BYTES
ARENA_CHUNK_BYTES = 64 << 20  # address space only: a chunk's pages are taken as they are first written
ARENA_ALIGN_BYTES = 64  # where a tensor starts in an arena, as the C allocator aligns one
THP_ENABLED = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_unavailable() -> str | None:
    """Why this process does not ask for 2 MiB pages, or None when it does."""
    if not env.huge_pages():
        return "turned off (BATCHSERVE_HUGE_PAGES=0)"
    return host_cannot()


@functools.cache
def host_cannot() -> str | None:
    """Why this host cannot give 2 MiB pages on request, or None when it can."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return "no MADV_HUGEPAGE on this platform"
    try:
        mode = THP_ENABLED.read_text()
    except OSError:
        return f"cannot read {THP_ENABLED.name} (no transparent huge pages)"
    if "[never]" in mode:
        return "transparent huge pages are off ([never])"
    return None


_logged: set[str] = set()
_log_lock = threading.Lock()


def _log_fallback_once(reason: str) -> None:
    with _log_lock:
        if reason in _logged:
            return
        _logged.add(reason)
    logger.info("large tensors stay on ordinary pages: %s", reason)


def _huge_page_mapping(nbytes: int) -> tuple[mmap.mmap, int] | None:
    """An anonymous mapping (zeroed) with room for `nbytes` from a 2 MiB boundary, advised MADV_HUGEPAGE, and that
    boundary's offset in it; None where not possible. The mapping is one huge page longer than asked, for the
    alignment: the bytes before the boundary are never touched, so they take address space, not memory."""
    reason = huge_pages_unavailable()
    if reason is not None:
        _log_fallback_once(reason)
        return None
    length = -(-nbytes // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES + HUGE_PAGE_BYTES
    try:
        mapping = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    except OSError as e:
        _log_fallback_once(f"mmap failed ({e})")
        return None
    offset = -_bytes_of(mapping).data_ptr() % HUGE_PAGE_BYTES
    try:
        mapping.madvise(mmap.MADV_HUGEPAGE, offset, length - offset)
    except OSError as e:
        _log_fallback_once(f"madvise(MADV_HUGEPAGE) refused ({e})")
    return mapping, offset


def _bytes_of(mapping: mmap.mmap) -> torch.Tensor:
    """The mapping's bytes as a uint8 tensor, which holds the mapping: it is unmapped when the last view goes."""
    return torch.frombuffer(mapping, dtype=torch.uint8)


def _mapped_bytes(nbytes: int) -> torch.Tensor | None:
    """`nbytes` zeroed bytes (uint8) from a 2 MiB boundary, advised MADV_HUGEPAGE; None where not possible."""
    mapped = _huge_page_mapping(nbytes)
    if mapped is None:
        return None
    mapping, offset = mapped
    return _bytes_of(mapping)[offset : offset + nbytes]


def _nbytes(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> int:
    return torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()


def zeros(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(shape, dtype, device), on 2 MiB pages where it is a CPU tensor of at least
    MIN_OWN_MAPPING_BYTES and the host allows it."""
    device = torch.device(device)
    nbytes = _nbytes(shape, dtype)
    if device.type != "cpu":
        _log_fallback_once(f"{device.type} memory is not the host's")
    elif nbytes >= MIN_OWN_MAPPING_BYTES:
        raw = _mapped_bytes(nbytes)
        if raw is not None:
            return raw.view(dtype).view(shape)
    return torch.zeros(shape, dtype=dtype, device=device)


def on_huge_pages(tensor: torch.Tensor) -> bool:
    """Whether `tensor`'s memory lies in a mapping advised MADV_HUGEPAGE (read from /proc/self/smaps: a check for
    tests and diagnostics, not for a hot path)."""
    address = tensor.data_ptr()
    for header, flags in _smaps_regions():
        start, end = (int(x, 16) for x in header.split()[0].split("-"))
        if start <= address < end:
            return "hg" in flags
    return False


def _smaps_regions() -> list[tuple[str, list[str]]]:
    regions: list[tuple[str, list[str]]] = []
    header = None
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(" ", 1)[0]
        if "-" in first and not first.endswith(":"):
            header = line
        elif first == "VmFlags:" and header is not None:
            regions.append((header, line.split()[1:]))
    return regions


class HugePageArena:
    """Tensors copied side by side into shared 2 MiB-page mappings (ARENA_CHUNK_BYTES each, or one of their own for a
    larger tensor), for the many weights of a model too small for a mapping each. The arena holds its current chunk
    weakly: a chunk is unmapped when the last tensor on it is freed, so a freed model leaves nothing behind. Where the
    host has no huge pages, copies are plain clones."""

    def __init__(self, chunk_bytes: int = ARENA_CHUNK_BYTES):
        self._chunk_bytes = chunk_bytes
        self._chunk: weakref.ref[mmap.mmap] | None = None
        self._start = 0  # the chunk's 2 MiB boundary
        self._used = 0
        self._lock = threading.Lock()

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """A contiguous copy of CPU `tensor` on huge pages (a plain contiguous clone where not possible)."""
        placed = self._on_huge_pages(tensor)
        return tensor.clone(memory_format=torch.contiguous_format) if placed is None else placed

    def place(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor`, which its caller has just made and no one else holds, on huge pages: copied there where the
        host allows, else kept as it is when contiguous (a clone would only cost a second pass over its bytes and
        the first touch of as many new pages)."""
        placed = self._on_huge_pages(tensor)
        if placed is not None:
            return placed
        return tensor if tensor.is_contiguous() else tensor.contiguous()

    def _on_huge_pages(self, tensor: torch.Tensor) -> torch.Tensor | None:
        """A copy of `tensor` in this arena, or None where the host cannot give one (the reason logged once)."""
        if tensor.device.type != "cpu":
            _log_fallback_once(f"{tensor.device.type} memory is not the host's")
            return None
        raw = self._take(tensor.numel() * tensor.element_size())
        if raw is None:
            return None
        out = raw.view(tensor.dtype).view(tensor.shape)
        out.copy_(tensor)
        return out

    def _take(self, nbytes: int) -> torch.Tensor | None:
        if nbytes == 0:
            return None
        if nbytes > self._chunk_bytes // 4:
            return _mapped_bytes(nbytes)  # a mapping of its own: a large tensor would leave most of a chunk unused
        with self._lock:
            chunk = self._chunk() if self._chunk is not None else None
            at = self._start + -(-self._used // ARENA_ALIGN_BYTES) * ARENA_ALIGN_BYTES
            if chunk is None or at + nbytes > self._start + self._chunk_bytes:
                mapped = _huge_page_mapping(self._chunk_bytes)
                if mapped is None:
                    return None
                chunk, self._start = mapped
                self._chunk, at = weakref.ref(chunk), self._start
            self._used = at + nbytes - self._start
            return _bytes_of(chunk)[at : at + nbytes]
