"""The pool rows the disk tier reads blocks into (worker/kv_offload.py PoolRows): a block's bytes go to exactly that
block of every layer part, in payload order, and the views the writer writes from hold exactly that block's bytes; a
pool that was replaced (a resize) gets views of its new tensors."""

from __future__ import annotations

import types

import torch

from batchserve.worker.kv_offload import PoolRows, block_payload_bytes, copy_blocks_in


def block_bytes(kv, block_id: int) -> bytes:
    """The block's bytes of every part in payload order, by torch (the reference the tier's views must equal)."""
    return b"".join(t[block_id].contiguous().view(torch.uint8).numpy().tobytes() for layer in kv.device_caches
                    for t in layer)  # fmt: skip


def written_bytes(rows: PoolRows, block_id: int) -> bytes:
    """What the writer hands TierStore.put for this block."""
    return b"".join(bytes(view) for view in rows.block(block_id))


def pool(blocks: int = 5, layers: int = 3):
    def part():
        return torch.zeros(blocks, 4, 2, 8, dtype=torch.bfloat16)

    return [(part(), part()) for _ in range(layers)]


def test_a_payload_lands_in_its_block_only_and_reads_back_out_equal():
    kv = types.SimpleNamespace(device_caches=pool())
    payload = torch.randint(0, 256, (block_payload_bytes(kv),), dtype=torch.uint8).numpy().tobytes()
    rows = PoolRows(kv)
    copy_blocks_in(kv, [(3, payload)], rows)
    assert block_bytes(kv, 3) == written_bytes(rows, 3) == payload
    others = [0, 1, 2, 4]
    assert all(not t[others].any() for layer in kv.device_caches for t in layer)
    kv.device_caches = pool(blocks=8)  # resized: the old views must not be written through
    copy_blocks_in(kv, [(7, payload)], rows)
    assert block_bytes(kv, 7) == written_bytes(rows, 7) == payload
    assert len(rows.block(7)) == 6 and all(view.nbytes == 4 * 2 * 8 * 2 for view in rows.block(7))


def test_the_engines_pool_takes_a_block_in_one_strided_copy():
    """The engine's pool (worker/kv_cache.py) is one allocation, its parts at one distance and 64-byte aligned: a
    block's rows of every part are one array, and a payload copied through it lands in that block only, bit for bit
    what the per-part copy would put there."""
    from batchserve.worker.kv_cache import _zeroed_pool

    kv = types.SimpleNamespace(device_caches=_zeroed_pool(3, 5, (4, 3, 8), torch.bfloat16, torch.device("cpu")))
    assert all(t.data_ptr() % 64 == 0 and t.is_contiguous() for layer in kv.device_caches for t in layer)
    rows = PoolRows(kv)
    assert rows.block_array(2) is not None and rows.block_array(2).shape == (6, 4 * 3 * 8 * 2)
    payload = torch.randint(0, 256, (block_payload_bytes(kv),), dtype=torch.uint8).numpy().tobytes()
    copy_blocks_in(kv, [(2, payload)], rows)
    assert block_bytes(kv, 2) == written_bytes(rows, 2) == payload
    others = [0, 1, 3, 4]
    assert all(not t[others].any() for layer in kv.device_caches for t in layer)
    separate = types.SimpleNamespace(device_caches=pool())  # parts of their own: one copy per part, as before
    assert PoolRows(separate).block_array(0) is None


def test_one_strided_copy_where_the_parts_do_not_lie_back_to_back():
    """A pool whose parts are padded apart (each rounded up to 64 bytes) still takes a block in one strided copy, into
    that block's rows of every part and nowhere else."""
    from batchserve.worker.kv_cache import _zeroed_pool

    kv = types.SimpleNamespace(device_caches=_zeroed_pool(2, 3, (1, 1, 3), torch.bfloat16, torch.device("cpu")))
    parts = [t for layer in kv.device_caches for t in layer]
    assert parts[1].data_ptr() - parts[0].data_ptr() == 64  # 3 blocks x 6 bytes, padded to 64
    rows = PoolRows(kv)
    payload = bytes(range(24))
    copy_blocks_in(kv, [(1, payload)], rows)
    assert rows.block_array(1) is not None
    assert block_bytes(kv, 1) == written_bytes(rows, 1) == payload
    assert all(block_bytes(kv, b) == written_bytes(rows, b) == bytes(24) for b in (0, 2))
