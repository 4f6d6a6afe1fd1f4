"""The shared-memory all-reduce (host/shared_allreduce.py) between this process and a child: every rank gets the sum
of the ranks' tensors, bit for bit the same, call after call through both halves of the buffer, in float32 and
bfloat16; a rank whose peer dies raises within a second instead of waiting."""

from __future__ import annotations

import time

import pytest
import torch

from batchserve.host.channel import start_child
from batchserve.host.shared_allreduce import SharedAllReduce, SharedBuffers
from tests.host.shared_allreduce_peer import CALLS, rank_tensor, reduce_in_child


def test_every_rank_gets_the_sum_call_after_call():
    buffers = SharedBuffers.allocate(2, 64 * 32)
    child = start_child(reduce_in_child, buffers, name="allreduce-peer")
    try:
        ours = SharedAllReduce(buffers, 0, child.is_alive)
        for call in range(CALLS):
            dtype = torch.float32 if call % 3 else torch.bfloat16
            x = rank_tensor(0, call, dtype)
            want = (rank_tensor(0, call, dtype).float() + rank_tensor(1, call, dtype).float()).to(dtype)
            assert torch.equal(ours(x), want)
            assert torch.equal(x.float(), torch.from_numpy(child.channel.recv(timeout=30)))  # the child's: same bits
    finally:
        child.stop()


def test_a_dead_peer_raises_within_a_second():
    buffers = SharedBuffers.allocate(2, 16)
    child = start_child(reduce_in_child, buffers, 0, name="allreduce-peer")  # reduces nothing, waits to be killed
    ours = SharedAllReduce(buffers, 0, child.is_alive)
    child.kill()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="a peer rank is gone"):
        ours(torch.ones(4))
    assert time.monotonic() - start < 1.0
