"""Tensor-parallel building blocks (Megatron's split): a rank's group and its collectives, a module whose output is
a partial sum all-reduced across the ranks (the row-parallel half of attention and of the MLP), the vocabulary-parallel
embedding and the gathered output projection.

The column-parallel half needs no module of its own: a rank's q/k/v and gate/up projections are ordinary CpuLinears
over its rows of the weight (models/sharding.py slices them at load), whose outputs stay sharded until the
row-parallel projection after them sums the ranks' partial products. So one layer costs two all-reduces (after o_proj,
after the MLP), the embedding one and the logits one all-gather.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
from torch import nn

from batchserve.host.shared_allreduce import SharedAllReduce


@dataclass
class CollectiveStats:
    """Time spent in this rank's collectives, and their count, since the last `take` (per step)."""

    seconds: float = 0.0
    calls: int = 0

    def take(self) -> CollectiveStats:
        taken = CollectiveStats(self.seconds, self.calls)
        self.seconds, self.calls = 0.0, 0
        return taken


@dataclass
class TensorParallel:
    """One rank's place in a tensor-parallel group: its rank, the group's size and the torch.distributed process group
    its collectives run in (None at size 1: nothing to reduce). The group is an object of its own, never torch's
    default group: several engines may live in one process."""

    rank: int = 0
    size: int = 1
    group: object | None = None
    stats: CollectiveStats = field(default_factory=CollectiveStats)
    shared: SharedAllReduce | None = None  # the ranks share this host: all-reduce through shared memory

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the ranks of x, in place, every rank getting the same bits: through shared memory where the
        ranks share a host (summed in float32, rounded once), else gloo's."""
        if not self.enabled:
            return x
        start = time.perf_counter()
        if self.shared is not None and self.shared.takes(x):
            self.shared(x)
        else:
            self.group.allreduce([x]).wait()
        self._count(start)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """The ranks' x [..., n] side by side -> [..., size * n], rank 0's first."""
        if not self.enabled:
            return x
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.group.allgather([parts], [x.contiguous()]).wait()
        self._count(start)
        return torch.cat(parts, dim=-1)

    def _count(self, start: float) -> None:
        self.stats.seconds += time.perf_counter() - start
        self.stats.calls += 1


SINGLE = TensorParallel()


class ReducedOutput(nn.Module):
    """A module whose output on each rank is a partial sum (a row-parallel projection, a MoE block over each rank's
    slice of every expert's intermediate columns): the sum over the ranks is the whole model's output."""

    def __init__(self, inner: nn.Module, tp: TensorParallel):
        super().__init__()
        self.inner = inner
        self.tp = tp

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        """The inner module's own arguments after x (an MLP's step adapters, which are refused with ranks but passed
        along as its caller gives them)."""
        return self.tp.all_reduce(self.inner(x, *args, **kwargs))

    def op(self):
        """The wrapped module's op (layers/op_plan.py), for the capabilities read off the plan; the native decoder
        loop never runs a sharded layer (it has no all-reduce), modes.py says so."""
        return self.inner.op()


def vocab_shard(vocab_size: int, tp: TensorParallel) -> tuple[int, int]:
    """(first row, rows per rank) of this rank's slice of a vocabulary padded to a multiple of the ranks."""
    per_rank = -(-vocab_size // tp.size)
    return tp.rank * per_rank, per_rank


class VocabParallelEmbedding(nn.Module):
    """The token embedding, rank r holding rows [r * V', (r + 1) * V') of the table (V' = V / size rounded up; the
    last rank's padding rows are zeros): each rank looks up the tokens it holds, zeros for the others, and the
    all-reduce sums the one non-zero row per token."""

    def __init__(
        self, vocab_size: int, hidden_size: int, tp: TensorParallel, dtype: torch.dtype | None = None, rows=None
    ):
        """`rows` 0: an empty table (a pipeline stage that neither embeds nor projects onto the vocabulary)."""
        super().__init__()
        self.tp = tp
        self.start, self.rows = vocab_shard(vocab_size, tp)
        self.rows = self.rows if rows is None else rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = nn.functional.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(x.masked_fill_(outside.unsqueeze(-1), 0))


class GatheredLogits(nn.Module):
    """The output projection over this rank's vocabulary rows, its logits gathered from every rank and the padding
    columns dropped: every rank holds the whole [N, V] (each samples the same tokens from the same logits and the
    same seeds, so no token travels between ranks)."""

    def __init__(self, inner: nn.Module, vocab_size: int, tp: TensorParallel):
        super().__init__()
        self.inner = inner
        self.vocab_size = vocab_size
        self.tp = tp

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.tp.all_gather_last(self.inner(hidden))[..., : self.vocab_size]


@dataclass
class PipelineStage:
    """One rank's pipeline stage: layers [first_layer, stop_layer) of the model, in stage `index` of `count`. The
    world group holds every rank (stage s, tensor-parallel rank t is world rank s * tp_size + t); activations go from
    each rank to the same tensor-parallel rank of the next stage, and the last stage's step output (its sampled
    tokens) is broadcast to every rank from its first rank.

    A step runs as up to `micro_batches` micro-batches (models/pipeline.py): a stage sends one micro-batch's
    activations without waiting for them to land and goes on to the next, so the stages compute at once. `timeline`
    holds this rank's (start, end) of each micro-batch of the last step, on time.monotonic's clock (CLOCK_MONOTONIC:
    one clock for every process of a host); `last_stage_timeline` the last stage's, which travels with the step's
    output."""

    index: int = 0
    count: int = 1
    first_layer: int = 0
    stop_layer: int = 0
    world: object | None = None
    world_rank: int = 0
    tp_size: int = 1
    stats: CollectiveStats = field(default_factory=CollectiveStats)
    micro_batches: int = 1
    timeline: list[tuple[float, float]] = field(default_factory=list)
    last_stage_timeline: list[tuple[float, float]] = field(default_factory=list)
    _sends: list = field(default_factory=list, repr=False)  # (work, tensor) of sends not yet waited for

    @property
    def is_first(self) -> bool:
        return self.index == 0

    @property
    def is_last(self) -> bool:
        return self.index == self.count - 1

    @property
    def layers(self) -> range:
        return range(self.first_layer, self.stop_layer)

    def send_activations(self, *tensors: torch.Tensor, micro_batch: int = 0) -> None:
        """Start sending a micro-batch's activations to the next stage; `finish_sends` waits for them (the tensors
        are held until then). Tag 2m + i: tensor i of micro-batch m."""
        start = time.perf_counter()
        for i, tensor in enumerate(tensors):
            tensor = tensor.contiguous()
            work = self.world.send([tensor], self.world_rank + self.tp_size, 2 * micro_batch + i)
            self._sends.append((work, tensor))
        self._count(start)

    def finish_sends(self) -> None:
        start = time.perf_counter()
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        self._count(start)

    def receive_activations(
        self, shape: tuple[int, ...], dtype: torch.dtype, count: int, micro_batch: int = 0
    ) -> list[torch.Tensor]:
        start = time.perf_counter()
        tensors = [torch.empty(shape, dtype=dtype) for _ in range(count)]
        for i, tensor in enumerate(tensors):
            self.world.recv([tensor], self.world_rank - self.tp_size, 2 * micro_batch + i).wait()
        self._count(start)
        return tensors

    def broadcast_from_last(self, message: object | None) -> object:
        """`message` (given on the last stage's first rank) on every rank, with the last stage's timeline: pickled,
        its length then its bytes."""
        import pickle

        import torch.distributed as dist

        start = time.perf_counter()
        root = (self.count - 1) * self.tp_size
        options = dist.BroadcastOptions()
        options.rootRank = root
        payload = pickle.dumps((message, self.timeline)) if self.world_rank == root else b""
        length = torch.tensor([len(payload)], dtype=torch.int64)
        self.world.broadcast([length], options).wait()
        data = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if payload
            else torch.empty(int(length), dtype=torch.uint8)
        )
        self.world.broadcast([data], options).wait()
        self._count(start)
        if self.world_rank == root:
            self.last_stage_timeline = list(self.timeline)
            return message
        message, self.last_stage_timeline = pickle.loads(data.numpy().tobytes())
        return message

    def _count(self, start: float) -> None:
        self.stats.seconds += time.perf_counter() - start
        self.stats.calls += 1


def split_layers(num_layers: int, stages: int) -> list[range]:
    """Each stage's layers: as even as the count allows, the earlier stages one more (the last stage also runs the
    output projection)."""
    per, extra = divmod(num_layers, stages)
    bounds = [0]
    for stage in range(stages):
        bounds.append(bounds[-1] + per + (1 if stage < extra else 0))
    return [range(bounds[i], bounds[i + 1]) for i in range(stages)]
