"""CUDA graphs for decode-only steps: one graph per batch size of a ladder, captured at start-up over static input
buffers; a step of n decoding sequences is padded up to the next captured size and replays that graph (one launch
for the whole forward pass instead of one per kernel). Mixed and prefill steps, and batches above the ladder or with
a longer context than the static block table holds, run eagerly.

Padding rows decode token 0 at position 0 with a context of one token read through a block table of zeros, and
write their K/V to the runner's scratch slot (never over a real sequence's cache); their outputs are dropped.

The capture itself is injected (`capture`): CudaGraphCapture on a GPU; the tests give one that records the sizes and
replays by calling the forward again on the same static buffers, which is what a graph replay computes.
"""

from __future__ import annotations

import bisect
import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from batchserve.layers.attention import AttentionMetadata, KVCache, SeqGroup

logger = logging.getLogger(__name__)

SMALL_SIZES = (1, 2, 4)  # then every multiple of LADDER_STEP (vLLM's ladder)
LADDER_STEP = 8
MiB = 1024**2

# forward(input_ids, positions, kv_caches, metadata) -> hidden states [T, hidden]
Forward = Callable[[torch.Tensor, torch.Tensor, list[KVCache], AttentionMetadata], torch.Tensor]


def capture_sizes(max_batch_size: int) -> list[int]:
    """The ladder of batch sizes to capture: 1, 2, 4, then every multiple of 8 up to max_batch_size (rounded up to a
    multiple of 8), so no batch the scheduler forms pads by more than 7 rows."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, not {max_batch_size}")
    top = -(-max_batch_size // LADDER_STEP) * LADDER_STEP
    small = [s for s in SMALL_SIZES if s < max_batch_size]
    if max_batch_size <= SMALL_SIZES[-1]:
        return small + [max_batch_size]
    return small + list(range(LADDER_STEP, top + 1, LADDER_STEP))


def padded_size(num_seqs: int, sizes: list[int]) -> int | None:
    """The smallest captured size that holds num_seqs sequences (sizes ascending), or None: above the ladder."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class GraphCapture(Protocol):
    def __call__(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        """Capture fn (a forward pass over static buffers) -> replay(), which reruns it and returns its output."""
        ...


class CudaGraphCapture:
    """torch.cuda.CUDAGraph: warm-up runs on a side stream (Triton compiles, cuBLAS picks its kernels), then one
    capture; all graphs share one memory pool (captured largest first, the smaller ones fit in its blocks)."""

    def __init__(self) -> None:
        self.pool = None

    def __call__(self, fn: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            out = fn()
        if self.pool is None:
            self.pool = graph.pool()

        def replay() -> torch.Tensor:
            graph.replay()
            return out

        return replay


@dataclass
class StaticDecodeInputs:
    """The buffers every captured graph reads, sized for the largest batch; a step's inputs are copied in."""

    input_ids: torch.Tensor  # [N] int64
    positions: torch.Tensor  # [N] int64
    slot_mapping: torch.Tensor  # [N] int64
    seq_lens: torch.Tensor  # [N] int64
    block_tables: torch.Tensor  # [N, max_blocks] int64
    query_start_loc: torch.Tensor  # [N + 1] int64: 0..N (one query each)

    @classmethod
    def allocate(cls, max_size: int, max_blocks: int, device: torch.device) -> StaticDecodeInputs:
        def zeros(*shape):
            return torch.zeros(shape, dtype=torch.int64, device=device)

        query_start_loc = torch.arange(max_size + 1, dtype=torch.int64, device=device)
        return cls(zeros(max_size), zeros(max_size), zeros(max_size), zeros(max_size) + 1, zeros(max_size, max_blocks),
                   query_start_loc)  # fmt: skip

    @property
    def max_blocks(self) -> int:
        return self.block_tables.shape[1]

    def metadata(self, size: int) -> AttentionMetadata:
        """Attention metadata of a decode-only batch of `size` rows over views of the buffers."""
        block_tables, seq_lens, positions = self.block_tables[:size], self.seq_lens[:size], self.positions[:size]
        decode = SeqGroup(token_range=(0, size), block_tables=block_tables, seq_lens=seq_lens, positions=positions,
                          max_query_len=1)  # fmt: skip
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:size],
            positions=positions,
            block_tables=block_tables,
            seq_lens=seq_lens,
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1,
            max_seq_len=self.max_blocks,  # a bound: no host value may change between replays
            query_pad_index=self.query_start_loc[:size],
            decode=decode,
        )

    def pad_all(self, scratch_slot: int) -> None:
        """Every row padding: what a capture runs on, so that it writes K/V to the scratch slot only (a recapture
        after the pool grew keeps live sequences in it)."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.slot_mapping.fill_(scratch_slot)
        self.seq_lens.fill_(1)
        self.block_tables.zero_()

    def fill(self, input_ids, positions, slot_mapping, seq_lens, block_tables, size: int, scratch_slot: int) -> None:
        """Copy a step's n decode rows in; rows n..size-1 become padding (see the module's docstring)."""
        n, width = block_tables.shape
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        self.block_tables[:n, width:].zero_()  # never read (beyond seq_len), kept valid block ids all the same
        if size > n:
            self.input_ids[n:size].zero_()
            self.positions[n:size].zero_()
            self.slot_mapping[n:size].fill_(scratch_slot)
            self.seq_lens[n:size].fill_(1)
            self.block_tables[n:size].zero_()


@dataclass
class CaptureReport:
    sizes: list[int]
    seconds: float
    memory_bytes: int  # device memory the graphs hold (0 off the GPU)


class DecodeGraphs:
    """The captured decode graphs of one model and KV pool; `takes(batch)` says whether a step can replay one."""

    def __init__(
        self,
        forward: Forward,
        kv_caches: Callable[[], list[KVCache]],
        sizes: list[int],
        max_blocks: int,
        scratch_slot: Callable[[], int],
        device: torch.device,
        capture: GraphCapture,
    ) -> None:
        self.forward = forward
        self.kv_caches = kv_caches  # the runner's pool as it is now (a resize replaces its tensors)
        self.sizes = sorted(sizes)
        self.scratch_slot = scratch_slot  # the runner's, as it is now (it moves when the pool grows)
        self.capture = capture
        self.inputs = StaticDecodeInputs.allocate(self.sizes[-1], max_blocks, device)
        self.graphs: dict[int, Callable[[], torch.Tensor]] = {}
        # the pool tensor the graphs were captured on, weakly: a reallocated pool may come back at the same address
        # (the old one is freed before the new one is allocated), so an address cannot tell the two apart
        self._captured_pool: weakref.ref[torch.Tensor] | None = None
        self.replays: dict[int, int] = {}  # padded size -> replays (for benchmarks and tests)

    def capture_all(self) -> CaptureReport:
        """(Re)capture every size, largest first; needed again after the KV pool is reallocated."""
        device = self.inputs.input_ids.device
        free_before = _free_memory(device)
        start = time.perf_counter()
        self.graphs.clear()
        self.inputs.pad_all(self.scratch_slot())
        for size in reversed(self.sizes):
            self.graphs[size] = self.capture(self._step_fn(size))
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        self._captured_pool = weakref.ref(self.kv_caches()[0][0])
        report = CaptureReport(self.sizes, time.perf_counter() - start, max(0, free_before - _free_memory(device)))
        logger.info(
            "CUDA graphs: %d decode batch sizes (%d..%d) captured in %.2f s, %.0f MiB (--enforce-eager turns them off)",
            len(report.sizes), report.sizes[0], report.sizes[-1], report.seconds, report.memory_bytes / MiB,
        )  # fmt: skip
        return report

    def _step_fn(self, size: int) -> Callable[[], torch.Tensor]:
        inputs = self.inputs

        def step() -> torch.Tensor:
            # the metadata is rebuilt at every call: its masks are computed from the buffers, never cached across
            return self.forward(
                inputs.input_ids[:size], inputs.positions[:size], self.kv_caches(), inputs.metadata(size)
            )

        return step

    def takes(self, metadata: AttentionMetadata) -> bool:
        """A decode-only step within the ladder and the static block table, on the pool the graphs were captured on."""
        decode = metadata.decode
        return (
            metadata.prefill is None
            and decode is not None
            and bool(self.graphs)
            and padded_size(decode.num_seqs, self.sizes) is not None
            and decode.block_tables.shape[1] <= self.inputs.max_blocks
            and self._captured_pool is not None
            and self._captured_pool() is self.kv_caches()[0][0]
        )

    def run(self, input_ids: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Replay the graph of the next size up for a step `takes` accepted -> hidden states of its n rows (a view of
        the graph's output: valid until the next replay)."""
        decode = metadata.decode
        n = decode.num_seqs
        size = padded_size(n, self.sizes)
        self.inputs.fill(input_ids, metadata.positions, metadata.slot_mapping, decode.seq_lens, decode.block_tables,
                         size, self.scratch_slot())  # fmt: skip
        self.replays[size] = self.replays.get(size, 0) + 1
        return self.graphs[size]()[:n]


def decode_graphs_for(runner) -> DecodeGraphs | None:
    """A ModelRunner's decode graphs, captured now; None (every step eager) off a CUDA device, with enforce_eager, or
    where attention on this pool would not be the Triton kernels (the torch path gathers the static block table's
    whole width at every step: slower than eager)."""
    from batchserve.layers.gpu import paged_attention as gpu_attention

    if runner.device.type != "cuda" or runner.engine_config.enforce_eager:
        return None  # the mode table sets enforce_eager where a mode rules graphs out (MoE, an 8-bit pool: modes.py)
    pool = runner.kv_caches[0]
    if not gpu_attention.supports(pool[0][:1, 0], pool):
        logger.info("CUDA graphs off: attention on this pool is not the Triton kernels (BATCHSERVE_GPU_ATTENTION)")
        return None
    max_len = runner.engine_config.scheduler.max_model_len or runner.model_config.max_position_embeddings
    graphs = DecodeGraphs(
        forward=runner.model,
        kv_caches=lambda: runner.kv_caches,
        sizes=capture_sizes(runner.engine_config.scheduler.max_batch_size),
        max_blocks=min(-(-max_len // runner.block_size), runner.max_kv_blocks),
        scratch_slot=lambda: runner.requests.scratch_slot,
        device=runner.device,
        capture=CudaGraphCapture(),
    )
    try:
        graphs.capture_all()
    except Exception:  # a GPU without a path through capture still serves, eagerly
        logger.exception("CUDA graph capture failed; every step runs eagerly (as with --enforce-eager)")
        return None
    return graphs


def _free_memory(device: torch.device) -> int:
    return torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else 0
