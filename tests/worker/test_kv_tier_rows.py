"""The pool rows the disk tier reads blocks into (worker/kv_offload.py PoolRows): a block's bytes go to exactly that
block of every layer part, in payload order, bit for bit what gather_parts copies out for the writer; a pool that was
replaced (a resize) gets views of its new tensors."""

from __future__ import annotations

import types

import torch

from batchserve.worker.kv_offload import PoolRows, block_payload_bytes, copy_blocks_in, gather_parts


def pool(blocks: int = 5, layers: int = 3):
    def part():
        return torch.zeros(blocks, 4, 2, 8, dtype=torch.bfloat16)

    return [(part(), part()) for _ in range(layers)]


def test_a_payload_lands_in_its_block_only_and_reads_back_out_equal():
    kv = types.SimpleNamespace(device_caches=pool())
    payload = torch.randint(0, 256, (block_payload_bytes(kv),), dtype=torch.uint8).numpy().tobytes()
    rows = PoolRows(kv)
    copy_blocks_in(kv, [(3, payload)], rows)
    assert b"".join(part[0].tobytes() for part in gather_parts(kv, [3])) == payload
    others = [0, 1, 2, 4]
    assert all(not t[others].any() for layer in kv.device_caches for t in layer)
    kv.device_caches = pool(blocks=8)  # resized: the old views must not be written through
    copy_blocks_in(kv, [(7, payload)], rows)
    assert b"".join(part[0].tobytes() for part in gather_parts(kv, [7])) == payload
    assert len(rows.block(7)) == 6 and all(view.nbytes == 4 * 2 * 8 * 2 for view in rows.block(7))
