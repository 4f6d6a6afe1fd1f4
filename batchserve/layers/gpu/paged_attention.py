"""Paged attention on a GPU by Triton kernels (triton_kernels.py), on the same AttentionMetadata groups as the CPU
paths in layers/attention.py: decode sequences split over their context (flash-decoding) with the query heads of a
KV head together, prefill chunks causal against their cached context; both read K/V through the block tables in place.

CUDA tensors run the compiled kernels; CPU tensors run them under Triton's interpreter, in a process started with
TRITON_INTERPRET=1 (the tests). `available()` says whether Triton imports here at all.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from batchserve import env

POOL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TARGET_PROGRAMS = 264  # decode programs worth launching: about two per SM of a large GPU


@functools.cache
def available() -> bool:
    """Triton imports (a CUDA build of torch ships it; `pip install batchserve[gpu]` otherwise)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def supports(query: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> bool:
    """The kernels take this call: CUDA tensors, a pool dtype they know, Triton importable, and not turned off
    (BATCHSERVE_GPU_ATTENTION=torch)."""
    return query.is_cuda and kv_cache[0].dtype in POOL_DTYPES and env.gpu_attention() == "triton" and available()


@functools.cache
def jitted(name: str):
    """A kernel of triton_kernels, jitted: compiled for the GPU, or interpreted when TRITON_INTERPRET=1 was set before
    Triton was first imported (the interpreter replaces the whole of triton.language then, so it is a process-wide
    choice)."""
    import triton

    from batchserve.layers.gpu import triton_kernels

    return triton.jit(triton_kernels.KERNELS[name])


def interpreting() -> bool:
    """Triton runs kernels under its interpreter in this process (the only way CPU tensors run them)."""
    import triton

    return bool(triton.knobs.runtime.interpret)


@dataclass(frozen=True)
class Tiling:
    """Launch shapes: tokens per K/V tile, query rows per prefill tile, context splits per decode sequence."""

    block_n: int = 64
    block_m: int = 64
    num_splits: int | None = None  # None: num_splits_for()


def num_splits_for(num_seqs: int, num_kv_heads: int, max_seq_len: int | None, block_n: int) -> int:
    """Context splits per decode sequence: enough programs to fill the GPU when the batch alone does not, never more
    splits than tiles of context. Depends only on the batch size when max_seq_len is None (a captured CUDA graph
    replays one launch shape for any context length)."""
    splits = max(1, min(16, -(-TARGET_PROGRAMS // (num_seqs * num_kv_heads))))
    if max_seq_len is not None:
        splits = min(splits, max(1, -(-max_seq_len // block_n)))
    return splits


def _common(query: torch.Tensor, kv_cache, block_tables: torch.Tensor) -> dict:
    key_cache, value_cache = kv_cache
    if key_cache.stride() != value_cache.stride() or key_cache.stride(-1) != 1 or query.stride(-1) != 1:
        raise ValueError("paged attention needs K and V pools of one layout and unit-stride head dims")
    head_dim = query.shape[-1]
    fp32 = key_cache.dtype == torch.float32 or not query.is_cuda
    return dict(
        consts=dict(
            HEAD_DIM=head_dim,
            BLOCK_D=max(16, 1 << (head_dim - 1).bit_length()),
            BLOCK_SIZE=key_cache.shape[1],
            DOT_FP32=fp32,
            PRECISION="ieee" if fp32 else "tf32",
        ),
        strides=(*key_cache.stride()[:3], block_tables.stride(0)),
    )


def paged_decode(
    query: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    max_seq_len: int | None = None,
    tiling: Tiling = Tiling(),
) -> torch.Tensor:
    """query [B, H, D] (one per sequence) over each sequence's first seq_lens[b] tokens in the pool -> [B, H, D]."""
    num_seqs, num_heads, head_dim = query.shape
    num_kv_heads = kv_cache[0].shape[2]
    group = num_heads // num_kv_heads
    common = _common(query, kv_cache, block_tables)
    consts = common["consts"]
    splits = tiling.num_splits or num_splits_for(num_seqs, num_kv_heads, max_seq_len, tiling.block_n)
    out = torch.empty_like(query)
    stats = (num_seqs, num_heads, splits)
    part_acc = query.new_empty((*stats, consts["BLOCK_D"]), dtype=torch.float32) if splits > 1 else out
    part_max = query.new_empty(stats, dtype=torch.float32) if splits > 1 else out
    part_sum = query.new_empty(stats, dtype=torch.float32) if splits > 1 else out
    jitted("decode_split")[(num_seqs, num_kv_heads, splits)](
        query, kv_cache[0], kv_cache[1], block_tables, seq_lens, out, part_acc, part_max, part_sum,
        scale * 1.4426950408889634, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *common["strides"],
        GROUP=group, GROUP_PAD=max(16, 1 << (group - 1).bit_length()), BLOCK_N=tiling.block_n, NUM_SPLITS=splits,
        **consts,
    )  # fmt: skip
    if splits > 1:
        jitted("decode_combine")[(num_seqs, num_heads)](
            out, part_acc, part_max, part_sum, out.stride(0), out.stride(1),
            HEAD_DIM=head_dim, BLOCK_D=consts["BLOCK_D"], NUM_SPLITS=splits,
            SPLITS_PAD=max(2, 1 << (splits - 1).bit_length()),
        )  # fmt: skip
    return out


def paged_prefill(
    query: torch.Tensor,
    kv_cache: tuple[torch.Tensor, torch.Tensor],
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_starts: torch.Tensor,
    max_query_len: int,
    scale: float,
    tiling: Tiling = Tiling(),
) -> torch.Tensor:
    """query [T, H, D]: the packed chunks of B sequences (sequence b's rows query_starts[b]..query_starts[b+1]-1, at
    the last positions of its seq_lens[b] tokens) -> [T, H, D], causal over each sequence's keys in the pool."""
    num_heads = query.shape[1]
    num_seqs = seq_lens.shape[0]
    group = num_heads // kv_cache[0].shape[2]
    common = _common(query, kv_cache, block_tables)
    out = torch.empty_like(query)
    grid = (num_seqs, num_heads, -(-max_query_len // tiling.block_m))
    jitted("prefill")[grid](
        query, kv_cache[0], kv_cache[1], block_tables, seq_lens, query_starts, out, scale * 1.4426950408889634,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1), *common["strides"],
        GROUP=group, BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n, **common["consts"],
        num_warps=8 if common["consts"]["BLOCK_D"] >= 128 else 4,  # a [64, 128] float32 accumulator in registers
    )  # fmt: skip
    return out


def decode_attention(query, key, value, kv_cache, group, scale: float, tiling: Tiling = Tiling()) -> torch.Tensor:
    """layers/attention.py's decode path, by the kernels (this step's K/V are already in the pool)."""
    return paged_decode(query, kv_cache, group.block_tables, group.seq_lens, scale, tiling=tiling)


def prefill_attention(query, key, value, kv_cache, group, scale: float, tiling: Tiling = Tiling()) -> torch.Tensor:
    """layers/attention.py's prefill path, by the kernels (this step's K/V are already in the pool)."""
    return paged_prefill(
        query, kv_cache, group.block_tables, group.seq_lens, group.query_starts, group.max_query_len, scale, tiling
    )
