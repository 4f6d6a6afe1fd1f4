"""A tensor- and pipeline-parallel layout's step time and memory, derived from a single-rank step-time model (a
measured profile or the roofline) and a cost model of the collectives, as the engine splits a model today
(docs/parallelism.md): TP=N ranks each compute 1/N of every projection, attention and the vocabulary and all-reduce a
`[tokens, hidden]` activation twice a layer (and once after the embedding), the logits all-gathered; PP=M stages run
one after the other (no micro-batches), handing the hidden state and the residual stream to the next stage, so
stages fit a model into memory and add no throughput."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from batchserve.simulator.analytic import CPU_DEFAULT_MAX_BYTES, DTYPE_BYTES, Shapes, kv_bytes_per_token
from batchserve.simulator.profile_file import Profile
from batchserve.simulator.shape import StepShape
from batchserve.simulator.step_model import LinearStepModel, RooflineStepModel, ScaledStepModel, StepTimeModel

GiB = 1024**3


@dataclass(frozen=True)
class Collective:
    """A ring collective's cost: each of the 2(N-1) phases of an all-reduce sends 1/N of the tensor (the N-1 of an
    all-gather), paying `latency_s` once per phase; `bandwidth` is the bytes/s one link carries."""

    bandwidth: float = 10e9  # shared-memory copies between ranks of one host: an assumption, not a measurement
    latency_s: float = 50e-6  # one hand-over between ranks (flags, a semaphore wake-up)

    def __post_init__(self) -> None:
        if not self.bandwidth > 0 or not self.latency_s >= 0:
            raise ValueError(
                f"collective bandwidth must be > 0 and latency >= 0 (got {self.bandwidth}, {self.latency_s})"
            )

    def all_reduce_s(self, nbytes: float, ranks: int) -> float:
        if ranks <= 1:
            return 0.0
        phases = 2 * (ranks - 1)
        return phases * (nbytes / ranks / self.bandwidth + self.latency_s)

    def all_gather_s(self, nbytes: float, ranks: int) -> float:
        """`nbytes`: the gathered (whole) tensor."""
        if ranks <= 1:
            return 0.0
        return (ranks - 1) * (nbytes / ranks / self.bandwidth + self.latency_s)

    def send_s(self, nbytes: float) -> float:
        return nbytes / self.bandwidth + self.latency_s


def serial_seconds(model: StepTimeModel, shape: StepShape) -> float:
    """The part of a single-rank step that every rank pays whole, not 1/N of: the host's per-step and per-sequence
    work (scheduling, batch building, launches). The rest (projections, attention, the LM head) splits over ranks."""
    if isinstance(model, ScaledStepModel):
        return serial_seconds(model.inner, shape) * model.scale_of(shape)
    if isinstance(model, LinearStepModel):
        if shape.seqs == 0:
            return 0.0
        return model.coefficients.get("steps", 0.0) + model.coefficients.get("seqs", 0.0) * shape.seqs
    if isinstance(model, RooflineStepModel):
        return 0.0 if shape.seqs == 0 else model.overhead_s + model.overhead_per_seq_s * shape.seqs
    return 0.0


@dataclass(frozen=True)
class Layout:
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    replicas: int = 1

    @property
    def ranks_per_replica(self) -> int:
        return self.tensor_parallel * self.pipeline_parallel

    def hosts(self, ranks_per_host: int = 1) -> int:
        """Hosts the layout's ranks fill, `ranks_per_host` a host."""
        return math.ceil(self.replicas * self.ranks_per_replica / ranks_per_host)

    def describe(self) -> str:
        return f"TP={self.tensor_parallel} x PP={self.pipeline_parallel} x {self.replicas} replica(s)"


def check_split(shapes: Shapes, tp: int, pp: int) -> None:
    """The engine's refusals (worker/parallel_executor.py), naming both numbers."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tensor_parallel_size and pipeline_parallel_size must be >= 1 (got {tp}, {pp})")
    for name, value in (("num_attention_heads", shapes.num_heads), ("intermediate_size", shapes.intermediate_size)):
        if value % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide the model's {name} {value}")
    kv = shapes.num_kv_heads
    if kv % tp and tp % kv:
        raise ValueError(
            f"tensor_parallel_size {tp} and the model's num_key_value_heads {kv}: neither divides the other"
        )
    if pp > shapes.num_layers:
        raise ValueError(f"pipeline_parallel_size {pp} is more than the model's num_hidden_layers {shapes.num_layers}")


@dataclass
class ParallelStepModel:
    """`inner` (the whole model on one rank) split over TP x PP ranks:
    serial + (inner - serial) / (N·M) x M stages + all-reduces + the logits' all-gather + M-1 stage hand-overs."""

    inner: StepTimeModel
    shapes: Shapes
    dtype: str
    tensor_parallel: int = 1
    pipeline_parallel: int = 1
    collective: Collective = Collective()
    kind: str = "parallel"
    spent_s: float = 0.0  # predicted so far: a run's totals (the simulator asks once a step)
    comm_spent_s: float = 0.0

    def __post_init__(self) -> None:
        check_split(self.shapes, self.tensor_parallel, self.pipeline_parallel)
        self.elem = DTYPE_BYTES[self.dtype]

    def activation_bytes(self, shape: StepShape) -> float:
        return float(shape.tokens * self.shapes.hidden_size * self.elem)

    def collective_seconds(self, shape: StepShape) -> float:
        """Tensor parallelism's collectives: 2 all-reduces a layer and one after the embedding, the logits gathered."""
        n = self.tensor_parallel
        if n == 1 or shape.seqs == 0:
            return 0.0
        reduces = (2 * self.shapes.num_layers + 1) * self.collective.all_reduce_s(self.activation_bytes(shape), n)
        logits = shape.samples * self.shapes.vocab_size * self.elem  # the output projection's dtype
        return reduces + self.collective.all_gather_s(logits, n)

    def handover_seconds(self, shape: StepShape) -> float:
        """Pipeline stages: the hidden state and the residual stream to each next stage, then the step's output
        (a token a sequence) broadcast back to the earlier stages."""
        m = self.pipeline_parallel
        if m == 1 or shape.seqs == 0:
            return 0.0
        return (m - 1) * self.collective.send_s(2 * self.activation_bytes(shape)) + self.collective.send_s(
            8 * shape.seqs
        )

    def seconds(self, shape: StepShape) -> tuple[float, float]:
        """(the step, its collectives and hand-overs), without counting them in the run's totals."""
        whole = self.inner.predict(shape)
        serial = min(serial_seconds(self.inner, shape), whole)
        stage = (whole - serial) / (self.tensor_parallel * self.pipeline_parallel)
        comm = self.collective_seconds(shape) + self.handover_seconds(shape)
        # no micro-batches: the stages run one after the other, so the step takes all M of them
        return serial + stage * self.pipeline_parallel + comm, comm

    def predict(self, shape: StepShape) -> float:
        step, comm = self.seconds(shape)
        self.spent_s += step
        self.comm_spent_s += comm
        return step

    def collective_share(self, shape: StepShape) -> float:
        """The share of a step spent in collectives and hand-overs."""
        step, comm = self.seconds(shape)
        return comm / step if step > 0 else 0.0

    @property
    def spent_share(self) -> float:
        """collective_share over every step predicted so far (the engine's benchmark reports rank 0's time in
        collectives so)."""
        return self.comm_spent_s / self.spent_s if self.spent_s > 0 else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**self.inner.to_dict(), "parallel": {"tensor_parallel": self.tensor_parallel,
                "pipeline_parallel": self.pipeline_parallel, "allreduce_bandwidth": self.collective.bandwidth,
                "allreduce_latency_s": self.collective.latency_s}}  # fmt: skip


@dataclass(frozen=True)
class RankMemory:
    """One rank of a TP x PP layout: its weights, the memory left for its KV pool, and the K/V bytes it keeps per
    token (its heads of its stage's layers)."""

    weight_bytes: int
    free_bytes: int
    kv_bytes_per_token: int

    @property
    def fits(self) -> bool:
        return self.free_bytes > 0


def rank_memory(shapes: Shapes, dtype: str, tp: int, pp: int, rank_memory_bytes: float) -> RankMemory:
    """Every projection and the vocabulary split N ways, the layers M ways (the first stage's share rounded up, as
    the engine's earlier stages take the extra layer); K/V heads split N ways, replicated when fewer than N."""
    elem = DTYPE_BYTES[dtype]
    layers = math.ceil(shapes.num_layers / pp)
    vocab_tables = 1 if shapes.tie_word_embeddings else 2
    # a stage holds the embedding or the output matrix, not both, unless it is the only stage
    tables = vocab_tables if pp == 1 else 1
    weights = (layers * shapes.layer_params + tables * shapes.head_params) * elem // tp
    heads = max(1, shapes.num_kv_heads // tp)
    kv = kv_bytes_per_token(shapes, dtype) * heads * layers // (shapes.num_kv_heads * shapes.num_layers)
    return RankMemory(int(weights), int(rank_memory_bytes - weights), max(1, int(kv)))


def kv_pool_bytes(free_bytes: int, fraction: float | None, device_kind: str) -> int:
    """The pool the engine gives itself out of what the weights leave (worker/kv_cache.py): `fraction` of it when
    given; otherwise 0.9 of it on a GPU, a quarter (at most 4 GiB) on a CPU."""
    if free_bytes <= 0:
        return 0
    if fraction is not None:
        return int(free_bytes * fraction)
    return int(free_bytes * 0.9) if device_kind == "gpu" else min(int(free_bytes * 0.25), CPU_DEFAULT_MAX_BYTES)


def whole_weight_bytes(shapes: Shapes, dtype: str) -> int:
    return shapes.total_params * DTYPE_BYTES[dtype]


def parallel_profile(profile: Profile, shapes: Shapes, tp: int, pp: int, collective: Collective | None = None,
                     rank_memory_bytes: float | None = None, fraction: float | None = None) -> Profile:  # fmt: skip
    """`profile` (one rank holding the whole model) as one replica of TP x PP ranks: the parallel step model, and
    each rank's KV pool (bytes and bytes a token) as the engine would size it. `rank_memory_bytes`: the memory each
    rank may use (default: what the profile's machine had, weights included). Raises ValueError when a rank's share
    of the weights does not fit it."""
    if shapes.num_layers <= 0:
        raise ValueError(f"model shapes {shapes.name} have no layers")
    if rank_memory_bytes is None:
        if not profile.memory_free_bytes:  # an older profile without its memory: each rank keeps its pool's bytes
            rank_memory_bytes = whole_weight_bytes(shapes, profile.dtype) + profile.kv_cache_bytes / 0.25
        else:
            rank_memory_bytes = profile.memory_free_bytes + whole_weight_bytes(shapes, profile.dtype)
    mem = rank_memory(shapes, profile.dtype, tp, pp, rank_memory_bytes)
    if not mem.fits:
        raise ValueError(f"{shapes.name} in {profile.dtype} at tensor_parallel_size {tp} x pipeline_parallel_size {pp}: "
                         f"a rank's weights ({mem.weight_bytes / GiB:.2f} GiB) do not fit its memory "
                         f"({rank_memory_bytes / GiB:.2f} GiB)")  # fmt: skip
    model = ParallelStepModel(profile.step_model, shapes, profile.dtype, tp, pp, collective or Collective())
    kind = profile.machine.get("kind", "cpu")
    return dataclasses.replace(
        profile, step_model=model, kv_bytes_per_token=mem.kv_bytes_per_token,
        kv_cache_bytes=kv_pool_bytes(mem.free_bytes, fraction, kind), memory_free_bytes=mem.free_bytes,
        notes={**profile.notes, "parallel": f"TP={tp} x PP={pp}, {mem.weight_bytes / GiB:.2f} GiB of weights a rank"},
    )  # fmt: skip
