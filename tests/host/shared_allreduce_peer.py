"""The child side of test_shared_allreduce (module level, so that a spawned interpreter can import it)."""

from __future__ import annotations

import torch

from batchserve.host.channel import Channel, PeerDeadError
from batchserve.host.shared_allreduce import SharedAllReduce, SharedBuffers

CALLS = 7


def rank_tensor(rank: int, call: int, dtype: torch.dtype) -> torch.Tensor:
    """A [call + 1, 32] tensor of values particular to (rank, call)."""
    generator = torch.Generator().manual_seed(100 * rank + call)
    return torch.randn((call + 1, 32), generator=generator).to(dtype)


def reduce_in_child(channel: Channel, buffers: SharedBuffers, calls: int = CALLS) -> None:
    """Rank 1: all-reduce `calls` tensors with the parent, sending each result back; then wait for the parent."""
    ours = SharedAllReduce(buffers, 1, channel.peer_alive)
    for call in range(calls):
        dtype = torch.float32 if call % 3 else torch.bfloat16
        channel.send(ours(rank_tensor(1, call, dtype)).float().numpy())  # a private copy (numpy)
    try:
        channel.recv()
    except PeerDeadError:
        return
