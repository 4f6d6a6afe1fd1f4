"""The worker's side of the disk tier (core/kv_tier.py): K/V blocks to bytes and back, and the writer thread.

A block's payload is every layer's parts (K and V; a quantized pool's codes and scales too) for that block, in layer
order, as raw bytes: a block read back is bit for bit the block written. A full block is never written again, so the
writer thread reads it from the pool itself: the block is held there (core/tier_holds.py) from its registration until
the thread has checksummed its rows in place and written them with one writev; the step copies nothing. When the pool
must reuse a held block first, or the writer owes more than WRITE_QUEUE_BYTES, the save is dropped (counted): a lost
future hit, never a wait on the step path.

Write-through, not write-on-evict: a block is written when it becomes full and hashed, not when the pool lets it go.
Under a steady load every block is evicted sooner or later, so write-on-evict writes as much, only later, and it
would hold up the step that reuses the block until the write is done; a restarted engine or a replica sharing the
directory would also miss every block still in the pool. The writer thread runs at the lowest CPU priority, so on a
host whose cores the steps keep busy its checksums and system calls take the time the steps leave idle.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Sequence

import numpy as np
import torch

from batchserve.config import EngineConfig
from batchserve.core.kv_offload import KVOffload, TierSave
from batchserve.core.kv_tier import TierStore
from batchserve.core.tier_holds import WriterHolds
from batchserve.worker.kv_cache import KVCache, _parts

logger = logging.getLogger(__name__)

# the most the writer may owe: blocks past it are not written. A held block costs no memory (it sits in the pool
# anyway, and the pool takes it back first when it needs it), so this only bounds how stale a save may get: 256 MiB
# is ~730 blocks of the default model, under a second of the writer's work; 64 MiB dropped a quarter of the saves
# of a 2,048-token step stream whose writer ran only in the steps' idle time
WRITE_QUEUE_BYTES = 256 << 20
DEFAULT_MAX_BYTES = 16 << 30  # kv_offload_max_bytes when only the directory is given


# Threads that read a prefix back. The tier can run two on one load job, but on the AMX host at two compute threads
# two read a 72-block prefix slower than one (13.1 ms against 7.4, the time to first token alike: docs/kv-offload.md).
TIER_READERS = 1


def _layout(kv_cache: KVCache) -> list[tuple[int, int, torch.dtype, tuple[int, ...]]]:
    """(layer, part, dtype, one block's shape) in payload order."""
    return [
        (i, j, t.dtype, tuple(t.shape[1:]))
        for i, layer in enumerate(kv_cache.device_caches)
        for j, t in enumerate(_parts(layer))
    ]


def block_payload_bytes(kv_cache: KVCache) -> int:
    return sum(
        torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        for _, _, dtype, shape in _layout(kv_cache)
    )


def tier_description(config: EngineConfig, model_config, kv_cache: KVCache, block_size: int) -> str:
    """What the tier's fingerprint covers: the model (its name or path and its shapes), the KV format and block
    size, and every layer's part shapes and types. Engines that differ in any of these never share a file."""
    parts = ";".join(f"{i}.{j}:{str(d).removeprefix('torch.')}{list(s)}" for i, j, d, s in _layout(kv_cache))
    mc = model_config
    return (
        f"model={config.model or 'default'} arch={mc.architecture} vocab={mc.vocab_size} hidden={mc.hidden_size} "
        f"layers={mc.num_layers} kv_heads={mc.num_kv_heads} head_dim={mc.head_dim} dtype={config.dtype} "
        f"kv_cache_dtype={config.cache.kv_cache_dtype} block_size={block_size} parts={parts}"
    )


class BlockWriter:
    """Writes full blocks straight from the pool on a thread of its own: each step hands over the saves it filled
    (`save`), and the block stays held in the pool (core/tier_holds.py) until the thread has checksummed its rows
    where they lie and written them with one writev."""

    def __init__(self, store: TierStore, kv_cache: KVCache, holds: WriterHolds) -> None:
        self.store = store
        self.holds = holds
        self._rows = PoolRows(kv_cache)  # the writer thread's own views of the pool
        self._thread = threading.Thread(target=self._run, name="kv-tier-write", daemon=True)
        self._thread.start()

    @property
    def num_skipped(self) -> int:
        """Saves dropped: the writer was behind its budget, or the pool reused the block before it was written."""
        return self.holds.num_dropped

    def save(self, saves: Sequence[TierSave]) -> None:
        """At the end of the step that filled these blocks: the writer may take them (no copy, nothing waits)."""
        self.holds.ready(saves)

    def _run(self) -> None:
        _lowest_priority()
        while (save := self.holds.take()) is not None:
            try:
                self.store.put(save.digest, self._rows.block(save.block_id), save.retention)
            except Exception:  # a writer that dies would silently stop the tier: log and go on
                logger.exception("KV tier: a block write failed; serving goes on")
            finally:
                self.holds.done(save)

    def flush(self) -> None:
        """Wait until every block handed over is written (tests, benchmarks, a pool resize)."""
        self.holds.flush()

    def close(self) -> None:
        self.holds.close()
        self._thread.join()


def _lowest_priority() -> None:
    """This thread (Linux keeps a nice value per thread) yields the CPU to the steps; elsewhere it stays as it is."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except (AttributeError, OSError):
        pass


def load_blocks(kv_cache: KVCache, loads: Sequence[tuple[int, bytes]]) -> None:
    """Copy checked payloads into their pool blocks (before the step's forward pass)."""
    if not loads:
        return
    device = kv_cache.device_caches[0][0].device
    ids = torch.tensor([block_id for block_id, _ in loads], dtype=torch.long, device=device)
    data = torch.frombuffer(bytearray(b"".join(p for _, p in loads)), dtype=torch.uint8).view(len(loads), -1)
    offset = 0
    for i, j, dtype, shape in _layout(kv_cache):
        size = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        part = data[:, offset : offset + size].contiguous().view(dtype).view(len(loads), *shape)
        _parts(kv_cache.device_caches[i])[j].index_copy_(0, ids, part.to(device))
        offset += size


def copy_blocks_in(kv_cache: KVCache, pairs: Sequence[tuple[int, object]], rows: PoolRows | None = None) -> None:
    """On the tier's reader thread, while steps run: checked payloads into their pool blocks, which no step reads
    before their request is admitted. numpy does the copies: a torch op on this thread could start an OpenMP team
    of its own beside the steps' threads. `rows`: the pool's byte views, made once (else made here). A pool in one
    allocation (worker/kv_cache.py) takes a block in one strided copy, which runs without the GIL; otherwise one
    copy per layer part."""
    rows = rows or PoolRows(kv_cache)
    for block_id, payload in pairs:
        src = np.frombuffer(payload, dtype=np.uint8)
        whole = rows.block_array(block_id)
        if whole is not None:
            np.copyto(whole, src.reshape(whole.shape))
            continue
        offset = 0
        for dst in rows.block(block_id):
            dst[:] = src[offset : offset + dst.nbytes].data
            offset += dst.nbytes


class PoolRows:
    """A pool block's rows of every layer part, in payload order: where the tier's readers put a checked block and
    where its writer reads one. As byte views (TierStore.read_into reads into them, TierStore.put writes from them)
    or, when the pool is one allocation with its parts at one distance from each other, as one strided [parts, bytes]
    array (copy_blocks_in fills it in one call). The views are made once per pool (a resize makes new ones) and a
    block's are slices of them: 60 tensor-to-numpy conversions a block cost about as much as its read. One instance
    per thread that uses it."""

    def __init__(self, kv_cache: KVCache) -> None:
        self.kv_cache = kv_cache
        self._of: list | None = None
        self._parts: list[tuple[memoryview, int]] = []  # (a part's flat bytes, one block's bytes of it)
        self._blocks: np.ndarray | None = None  # [parts, blocks, bytes]: every part at once, when they allow it

    def block(self, block_id: int) -> list[memoryview]:
        self._refresh()
        return [flat[block_id * size : (block_id + 1) * size] for flat, size in self._parts]

    def block_array(self, block_id: int) -> np.ndarray | None:
        """The block's rows of every part as one writable [parts, bytes] array; None when the parts are not one
        allocation at one distance (a quantized pool's codes and scales)."""
        self._refresh()
        return None if self._blocks is None else self._blocks[:, block_id]

    def _refresh(self) -> None:
        caches = self.kv_cache.device_caches
        if caches is self._of:
            return
        tensors = [_parts(caches[i])[j] for i, j, _ in _part_sizes(self.kv_cache)]
        rows = [_byte_rows(t) for t in tensors]
        self._parts = [(memoryview(r).cast("B"), r.shape[1]) for r in rows]
        self._blocks = _one_array(tensors, rows)
        self._of = caches


def _one_array(tensors: list[torch.Tensor], rows: list[np.ndarray]) -> np.ndarray | None:
    """`rows` (each part's [blocks, bytes]) as one [parts, blocks, bytes] view of their memory, when the parts share
    one allocation, one shape and one distance from each part to the next; else None."""
    first = rows[0]
    storage = tensors[0].untyped_storage().data_ptr()
    addresses = [t.data_ptr() for t in tensors]
    step = addresses[1] - addresses[0] if len(tensors) > 1 else first.nbytes
    if step < first.nbytes or any(r.shape != first.shape for r in rows):
        return None
    if any(t.untyped_storage().data_ptr() != storage for t in tensors):
        return None
    if any(b - a != step for a, b in zip(addresses, addresses[1:])):
        return None
    return np.lib.stride_tricks.as_strided(first, shape=(len(rows), *first.shape), strides=(step, *first.strides))


def _byte_rows(part: torch.Tensor) -> np.ndarray:
    return part.view(part.shape[0], -1).view(torch.uint8).numpy()


def _part_sizes(kv_cache: KVCache) -> list[tuple[int, int, int]]:
    return [
        (i, j, torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size())
        for i, j, dtype, shape in _layout(kv_cache)
    ]


def attach_tier(config: EngineConfig, runner, kv_manager) -> KVOffload | None:
    """Open the tier for this runner's KV layout and connect both sides: the scheduler's KV cache manager looks up
    and reads, the runner loads and saves. None when kv_offload_dir is unset."""
    cache = config.cache
    if not cache.kv_offload_dir:
        return None
    from batchserve.core.retention import retention_of

    max_bytes = cache.kv_offload_max_bytes if cache.kv_offload_max_bytes is not None else DEFAULT_MAX_BYTES
    description = tier_description(config, runner.model_config, runner.kv_cache, runner.block_size)
    store = TierStore(cache.kv_offload_dir, description, max_bytes, block_payload_bytes(runner.kv_cache))
    offload = KVOffload(
        store, block_payload_bytes(runner.kv_cache), retention_of(cache.block_size), readers=TIER_READERS
    )
    kv_manager.tier = offload
    rows = PoolRows(runner.kv_cache)
    offload.copy_in = lambda pairs: copy_blocks_in(runner.kv_cache, pairs, rows)
    # a pool in one allocation takes a block read into the reader's buffer in one copy (fewer calls than a readv into
    # 60 rows and 60 CRC calls over them); other pools are read straight into their rows
    offload.views_of = None if rows.block_array(0) is not None else rows.block
    holds = WriterHolds(WRITE_QUEUE_BYTES // block_payload_bytes(runner.kv_cache), lambda d: store.release((d,)))
    offload.writer_holds = kv_manager.pool.writer_holds = holds
    runner.offload = BlockWriter(store, runner.kv_cache, holds)
    logger.info(
        "KV tier: %s, %d blocks (%.2f of %.2f GiB) found from earlier runs",
        store.dir,
        len(store),
        store.stats.bytes_used / (1 << 30),
        max_bytes / (1 << 30),
    )
    return offload
