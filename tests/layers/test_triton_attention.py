"""The Triton paged-attention kernels (layers/gpu) under Triton's interpreter, on the CPU, against the torch
reference of layers/attention.py (gather through the block tables, pad, SDPA): random block tables, odd lengths,
GQA ratios 1/3/8, head sizes 64 and 128, decode split over the context or not, prefill chunks after cached context.
Shapes stay small: the interpreter runs every program in Python."""

from __future__ import annotations

import os
import random
import subprocess
import sys

# The interpreter must be chosen before Triton is first imported (it swaps the whole of triton.language); this module
# is imported at collection, before any test of the process runs.
if "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

from batchserve.core.outputs import NewRequestData, SchedulerOutput
from batchserve.layers import attention, kernels
from batchserve.layers.gpu import paged_attention as gpu
from batchserve.sampling_params import SamplingParams
from batchserve.worker.input_batch import RequestTable

pytestmark = [
    pytest.mark.skipif(not gpu.available(), reason="triton is not importable"),
    pytest.mark.skipif(
        gpu.available() and not gpu.interpreting(), reason="triton was imported before the interpreter was chosen"
    ),
]

TILING = gpu.Tiling(block_n=16, block_m=16)


def make_step(seqs, num_kv_heads, head_dim, block_size, dtype, seed, garbage=0.0):
    """seqs: (tokens already cached, tokens this step) per sequence. A pool of random K/V behind shuffled block
    tables; slots no sequence owns hold `garbage` (NaN: must never reach the output) -> (pool, metadata)."""
    rng = random.Random(seed)
    torch.manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 4
    free = list(range(num_blocks))
    rng.shuffle(free)
    new_reqs, scheduled = [], {}
    for i, (cached, n) in enumerate(seqs):
        blocks = [free.pop() for _ in range(-(-(cached + n) // block_size))]
        new_reqs.append(NewRequestData(f"r{i}", list(range(cached + n)), cached + n, SamplingParams(), blocks, cached))
        scheduled[f"r{i}"] = n
    step = SchedulerOutput(new_requests=new_reqs, num_scheduled_tokens=scheduled)
    table = RequestTable(block_size)
    table.apply(step)
    metadata = table.build(step, torch.device("cpu")).attn_metadata
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    pool = tuple(torch.full(shape, garbage, dtype=dtype) for _ in range(2))
    for cache in pool:
        owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
        for req in new_reqs:
            for b in req.block_ids:
                owned[b * block_size : (b + 1) * block_size] = True
        flat = cache.view(-1, num_kv_heads, head_dim)
        flat[owned] = torch.randn(int(owned.sum()), num_kv_heads, head_dim).to(dtype)
    return pool, metadata


def torch_reference(path, query, pool, group, scale, monkeypatch):
    """The torch code of layers/attention.py for a group (native CPU kernels off): decode gathers and pads, prefill
    pads the chunks (fresh prompts: one causal SDPA each on this step's K/V, read back from the pool here)."""
    monkeypatch.setattr(kernels, "for_tensors", lambda *tensors, dtypes=None: None)
    rows = slice(*group.token_range)
    if path == "prefill":
        return attention._padded_prefill_attention(query[rows], *_step_kv(group, pool), pool, group, scale)
    return attention.decode_attention(query[rows], None, None, pool, group, scale)


def _step_kv(group, pool):
    """This step's K and V of a prefill group, read from the pool at its sequences' last positions."""
    block_size, num_kv_heads, head_dim = pool[0].shape[1:]
    slots = [
        int(group.block_tables[i, pos // block_size]) * block_size + pos % block_size
        for i, (start, stop, context) in enumerate(group.spans)
        for pos in range(context, context + stop - start)
    ]
    index = torch.tensor(slots)
    return tuple(cache.view(-1, num_kv_heads, head_dim)[index] for cache in pool)


def run_case(seqs, heads, head_dim, dtype, tiling, monkeypatch, seed=0, block_size=16):
    num_heads, num_kv_heads = heads
    pool, meta = make_step(seqs, num_kv_heads, head_dim, block_size, dtype, seed)
    nan_pool, _ = make_step(seqs, num_kv_heads, head_dim, block_size, dtype, seed, garbage=float("nan"))
    query = torch.randn(meta.slot_mapping.shape[0], num_heads, head_dim).to(dtype)
    scale = head_dim**-0.5
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    checked = 0
    for path, group in (("decode", meta.decode), ("prefill", meta.prefill)):
        if group is None:
            continue
        expected = torch_reference(path, query, pool, group, scale, monkeypatch)
        kernel = gpu.decode_attention if path == "decode" else gpu.prefill_attention
        rows = slice(*group.token_range)
        got = kernel(query[rows], None, None, nan_pool, group, scale, tiling)
        assert got.dtype == dtype and got.shape == expected.shape
        torch.testing.assert_close(got.float(), expected.float(), atol=tol, rtol=tol)
        checked += 1
    return checked


@pytest.mark.parametrize(
    "heads, head_dim", [((2, 2), 64), ((6, 2), 128), ((8, 1), 64)], ids=["mha-d64", "gqa3-d128", "gqa8-d64"]
)
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_matches_reference(heads, head_dim, splits, monkeypatch):
    seqs = [(0, 1), (36, 1), (16, 1), (70, 1)]  # odd lengths, one a whole block, one a fresh single token
    tiling = gpu.Tiling(block_n=16, block_m=16, num_splits=splits)
    assert run_case(seqs, heads, head_dim, torch.float32, tiling, monkeypatch, seed=splits) == 1


@pytest.mark.parametrize(
    "heads, head_dim", [((2, 2), 64), ((3, 1), 128), ((8, 1), 64)], ids=["mha-d64", "gqa3-d128", "gqa8-d64"]
)
def test_prefill_matches_reference(heads, head_dim, monkeypatch):
    seqs = [(0, 19), (21, 7), (33, 2)]  # a fresh prompt, chunks after cached context of odd lengths
    assert run_case(seqs, heads, head_dim, torch.float32, TILING, monkeypatch) == 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mixed_step_in_half_precision(dtype, monkeypatch):
    """A mixed step (decodes and prefill chunks) on bfloat16 and float16 pools; the output keeps the pool dtype."""
    seqs = [(40, 1), (5, 1), (0, 13), (17, 9)]
    tiling = gpu.Tiling(block_n=16, block_m=16, num_splits=2)
    assert run_case(seqs, (6, 2), 64, dtype, tiling, monkeypatch, seed=3) == 2


def test_tiles_spanning_several_pool_blocks(monkeypatch):
    """A K/V tile of 32 tokens over pool blocks of 8 (each token looks up its own block), decode and prefill."""
    seqs = [(29, 1), (3, 1), (0, 21), (45, 6)]
    tiling = gpu.Tiling(block_n=32, block_m=16, num_splits=2)
    assert run_case(seqs, (3, 1), 64, torch.float32, tiling, monkeypatch, seed=5, block_size=8) == 2


def test_default_tiling_splits_by_batch_only():
    """The number of context splits depends on the batch (and a known context), so a CUDA graph captured for a batch
    size replays one launch shape for every context length."""
    assert gpu.num_splits_for(1, 1, None, 64) == 16
    assert gpu.num_splits_for(1, 1, 100, 64) == 2  # no more splits than tiles of context
    assert gpu.num_splits_for(256, 3, None, 64) == 1


COMPILE_FOR_HOPPER = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from batchserve.layers.gpu import triton_kernels as K

INTS = ("stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_kb", "stride_kt", "stride_kh", "stride_bt")


def compile_for_sm90(fn, pointers, consts, num_warps, scalars=None):
    jitted = triton.jit(fn)
    types = {**pointers, **dict.fromkeys(INTS, "i32"), "qk_scale": "fp32", **(scalars or {}),
             **dict.fromkeys(consts, "constexpr")}
    signature = {name: types[name] for name in jitted.arg_names}
    source = ASTSource(fn=jitted, signature=signature, constexprs=consts)
    kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    assert kernel.asm["cubin"], fn.__name__
    print(fn.__name__, "compiled")


bf16 = dict(q_ptr="*bf16", k_cache="*bf16", v_cache="*bf16", block_tables="*i64", seq_lens="*i64", out_ptr="*bf16")
shapes = dict(HEAD_DIM=128, BLOCK_D=128, BLOCK_SIZE=16, BLOCK_N=64, DOT_FP32=False, PRECISION="tf32")
parts = dict(part_acc="*fp32", part_max="*fp32", part_sum="*fp32")
compile_for_sm90(K.decode_split, {**bf16, **parts}, dict(GROUP=4, GROUP_PAD=16, NUM_SPLITS=4, **shapes), 4)
compile_for_sm90(K.decode_combine, dict(out_ptr="*bf16", **parts),
                 dict(HEAD_DIM=128, BLOCK_D=128, NUM_SPLITS=4, SPLITS_PAD=4), 4)
compile_for_sm90(K.prefill, {**bf16, "query_starts": "*i64"}, dict(GROUP=4, BLOCK_M=64, **shapes), 8)
compile_for_sm90(K.rms_norm_residual, dict(x_ptr="*bf16", residual_ptr="*bf16", weight_ptr="*bf16", out_ptr="*bf16"),
                 dict(BLOCK=4096, HAS_RESIDUAL=True), 8,
                 dict(eps="fp32", stride_x="i32", stride_r="i32", stride_o="i32", hidden="i32"))
"""


def test_kernels_compile_for_hopper():
    """The kernels as the GPU runs them (not interpreted): Triton's compiler down to an sm_90 (H100/H200) binary, with
    the ptxas its wheel ships; no GPU needed. A fresh process: this one interprets."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_FOR_HOPPER], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = ["decode_split", "decode_combine", "prefill", "rms_norm_residual"]
    assert done.stdout.split("\n")[:4] == [f"{name} compiled" for name in compiled]
