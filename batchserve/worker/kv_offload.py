"""The worker's side of the disk tier (core/kv_tier.py): K/V blocks to bytes and back, and the writer thread.

A block's payload is every layer's parts (K and V; a quantized pool's codes and scales too) for that block, in layer
order, as raw bytes: a block read back is bit for bit the block written. Saves are copied out of the pool at the end of
the step that filled them (a copy: the pool block may be reused next step) and written by a background thread, so the
step never waits on the disk; when the writer falls behind by more than WRITE_QUEUE_BYTES, later saves are skipped
(counted) rather than let the queue grow or the step wait.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Sequence

import torch

from batchserve.config import EngineConfig
from batchserve.core.kv_offload import KVOffload, TierSave
from batchserve.core.kv_tier import TierStore
from batchserve.worker.kv_cache import KVCache, _parts

logger = logging.getLogger(__name__)

WRITE_QUEUE_BYTES = 256 << 20
DEFAULT_MAX_BYTES = 16 << 30  # kv_offload_max_bytes when only the directory is given


def _layout(kv_cache: KVCache) -> list[tuple[int, int, torch.dtype, tuple[int, ...]]]:
    """(layer, part, dtype, one block's shape) in payload order."""
    return [
        (i, j, t.dtype, tuple(t.shape[1:]))
        for i, layer in enumerate(kv_cache.device_caches)
        for j, t in enumerate(_parts(layer))
    ]


def block_payload_bytes(kv_cache: KVCache) -> int:
    return sum(torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
               for _, _, dtype, shape in _layout(kv_cache))


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
    """Copies blocks out at step end; a thread turns them into bytes and writes them to the store."""

    def __init__(self, store: TierStore, max_queued_bytes: int = WRITE_QUEUE_BYTES) -> None:
        self.store = store
        self.max_queued_bytes = max_queued_bytes
        self.num_skipped = 0  # saves dropped because the writer was behind
        self._queued_bytes = 0
        self._per_block = 0
        self._lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="kv-tier-write", daemon=True)
        self._thread.start()

    def save(self, kv_cache: KVCache, saves: Sequence[TierSave]) -> None:
        per_block = self._per_block = self._per_block or block_payload_bytes(kv_cache)  # the layout never changes
        with self._lock:
            room = max(0, (self.max_queued_bytes - self._queued_bytes) // per_block)
            if room < len(saves):
                self.num_skipped += len(saves) - room
                self.store.release(s.digest for s in saves[room:])
                saves = saves[:room]
            self._queued_bytes += len(saves) * per_block
        if not saves:
            return
        device = kv_cache.device_caches[0][0].device
        ids = torch.tensor([s.block_id for s in saves], dtype=torch.long, device=device)
        copies = [t.index_select(0, ids).to("cpu") for layer in kv_cache.device_caches for t in _parts(layer)]
        self._queue.put((list(saves), copies, per_block))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                saves, copies, per_block = item
                for n, save in enumerate(saves):
                    payload = torch.cat([c[n].reshape(-1).view(torch.uint8) for c in copies]).numpy().tobytes()
                    self.store.put(save.digest, payload, save.retention)
                with self._lock:
                    self._queued_bytes -= len(saves) * per_block
            except Exception:  # a writer that dies would silently stop the tier: log and go on
                logger.exception("KV tier: a block write failed; serving goes on")
            finally:
                self._queue.task_done()

    def flush(self) -> None:
        """Wait until every queued block is written (tests, benchmarks, shutdown)."""
        self._queue.join()

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


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
    offload = KVOffload(store, block_payload_bytes(runner.kv_cache), retention_of(cache.block_size))
    kv_manager.tier = offload
    runner.offload = BlockWriter(store)
    logger.info(
        "KV tier: %s, %d blocks (%.2f of %.2f GiB) found from earlier runs",
        store.dir, len(store), store.stats.bytes_used / (1 << 30), max_bytes / (1 << 30),
    )
    return offload
