"""Paged attention against plain causal SDPA, on random tensors and mixed prefill/decode batches."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from batchserve.core.outputs import NewRequestData, SchedulerOutput
from batchserve.layers import attention, kernels
from batchserve.layers.attention import paged_attention, preferred_prefill_method
from batchserve.sampling_params import SamplingParams
from batchserve.worker.input_batch import RequestTable

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 8


def reference(q_full, k_full, v_full, query_len):
    """Causal attention over the whole sequence [L, H, D]; the last query_len rows."""
    group = q_full.shape[1] // k_full.shape[1]
    q = q_full.transpose(0, 1)[None]
    k = k_full.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    v = v_full.repeat_interleave(group, dim=1).transpose(0, 1)[None]
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1)
    return out[-query_len:]


def run_batch(
    seqs: list[tuple[int, int]],
    block_size: int,
    seed: int = 0,
    stale: bool = False,
    heads: tuple[int, int, int] = (HEADS, KV_HEADS, HEAD_DIM),
    dtype: torch.dtype = torch.float32,
    tensors: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] | None = None,
):
    """seqs: (already cached tokens, tokens this step). Cached K/V are written by an earlier 'step' first.
    heads: (query heads, kv heads, head dim); dtype: of q/k/v and the pool (the reference computes in float32);
    tensors: each sequence's q, k, v over its whole length (default: random)."""
    num_heads, num_kv_heads, head_dim = heads
    torch.manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 3
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    kv_cache = (torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype))
    free = list(range(num_blocks))
    rng.shuffle(free)
    full = []  # per seq: q, k, v over the whole sequence
    new_reqs, scheduled = [], {}
    for i, (cached, n) in enumerate(seqs):
        length = cached + n
        blocks = [free.pop() for _ in range(-(-length // block_size))]
        q, k, v = (
            tensors[i]
            if tensors is not None
            else (
                torch.randn(length, num_heads, head_dim).to(dtype),
                torch.randn(length, num_kv_heads, head_dim).to(dtype),
                torch.randn(length, num_kv_heads, head_dim).to(dtype),
            )
        )
        full.append((q, k, v))
        new_reqs.append(NewRequestData(f"r{i}", list(range(length)), length, SamplingParams(), blocks, cached))
        scheduled[f"r{i}"] = n
    if stale:  # leftovers of earlier requests in unwritten slots must never reach the output
        for t in kv_cache:
            t.normal_(0.0, 100.0)
            t.view(-1)[::7] = float("nan")  # even NaN garbage
    # Write the cached part as an earlier step would have.
    states = RequestTable(block_size)
    prefill = SchedulerOutput(
        new_requests=[
            NewRequestData(r.req_id, r.token_ids, r.num_prompt_tokens, r.sampling_params, r.block_ids, 0)
            for r in new_reqs
        ],
        num_scheduled_tokens={r.req_id: c for r, (c, _) in zip(new_reqs, seqs, strict=True) if c > 0},
    )
    states.apply(prefill)
    if prefill.num_scheduled_tokens:
        batch = states.build(prefill, torch.device("cpu"))
        ids = [int(r[1:]) for r in batch.req_ids]  # in the batch's packing order
        q = torch.cat([full[i][0][: seqs[i][0]] for i in ids])
        k = torch.cat([full[i][1][: seqs[i][0]] for i in ids])
        v = torch.cat([full[i][2][: seqs[i][0]] for i in ids])
        paged_attention(q, k, v, kv_cache, batch.attn_metadata)
    # The step under test.
    step = SchedulerOutput(new_requests=new_reqs, num_scheduled_tokens=scheduled)
    states = RequestTable(block_size)
    states.apply(step)
    batch = states.build(step, torch.device("cpu"))
    # the batch packs its sequences in its own order (decodes first)
    order = [int(r[1:]) for r in batch.req_ids]
    q = torch.cat([full[i][0][seqs[i][0] :] for i in order])
    k = torch.cat([full[i][1][seqs[i][0] :] for i in order])
    v = torch.cat([full[i][2][seqs[i][0] :] for i in order])
    out = paged_attention(q, k, v, kv_cache, batch.attn_metadata)
    expected = torch.cat([reference(*(t.float() for t in full[i]), seqs[i][1]) for i in order])
    return out, expected, batch


@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize(
    "seqs",
    [
        [(0, 13)],  # a whole prompt
        [(0, 5), (0, 17), (0, 1)],  # several prompts
        [(9, 1), (30, 1), (0, 1), (15, 1)],  # pure decode
        [(20, 7), (11, 1), (0, 9), (16, 1), (3, 16)],  # prefill chunks with cached context mixed with decodes
    ],
)
@pytest.mark.parametrize("native", [True, False], ids=["native-kernel", "torch-path"])
def test_paged_attention_matches_causal_sdpa(seqs, block_size, native, monkeypatch, request):
    if native:
        request.getfixturevalue("native_kernels")
    else:
        monkeypatch.setattr(kernels, "load", lambda: None)
    out, expected, batch = run_batch(seqs, block_size)
    assert (batch.attn_metadata.prefill is None) == all(n == 1 for _, n in seqs)
    assert (batch.attn_metadata.decode is None) == all(n > 1 for _, n in seqs)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_stale_slots_are_masked(native_kernels):
    # Masked slots (block tails, free blocks) holding another request's leftovers do not change the output. The
    # leftovers include NaN, which only the kernels keep out (the torch path multiplies masked values by 0).
    for seqs in ([(5, 1), (12, 1)], [(5, 3), (12, 1)]):
        out, expected, _ = run_batch(seqs, 8, stale=True)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


def test_random_mixed_batches():
    rng = random.Random(1)
    for seed in range(6):
        seqs = [(rng.randrange(0, 40), rng.choice([1, 1, rng.randrange(1, 20)])) for _ in range(rng.randrange(1, 6))]
        out, expected, _ = run_batch(seqs, rng.choice([8, 16]), seed=seed)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 128), (2, 2, 32), (4, 2, 48)], ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 24, 32])
@pytest.mark.parametrize("num_seqs", [6, 40], ids=["per-kv-head-items", "per-sequence-items"])
def test_decode_kernel_model_shapes(heads, block_size, num_seqs, native_kernels):
    # The native kernel's vectorized path (head_dim 32/64/128) and its portable loop (48): long contexts that span
    # many 16-token tiles and partial blocks, with stale garbage (NaN included) in every unwritten slot. A few
    # sequences are split by kv head across threads; many are one work item each.
    contexts = [0, 15, 16, 47, 130, 255]
    seqs = [(contexts[i % 6] + i // 6, 1) for i in range(num_seqs)]
    out, expected, batch = run_batch(seqs, block_size, stale=True, heads=heads)
    assert batch.attn_metadata.prefill is None
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 128), (2, 2, 32)], ids=str)
@pytest.mark.parametrize("block_size", [8, 16, 24])
def test_prefill_kernel_model_shapes(heads, block_size, native_kernels):
    # The native prefill kernel: prompts shorter and longer than its 16-row tiles, chunks whose cached context ends
    # mid-block or mid-tile, next to decodes; stale garbage (NaN included) in every unwritten slot.
    if not native_kernels.prefill_attention_available(heads[2]):
        pytest.skip("native prefill kernel not built here")
    seqs = [(0, 5), (0, 16), (0, 37), (13, 20), (40, 1), (7, 33), (16, 16), (0, 2), (100, 3)]
    out, expected, batch = run_batch(seqs, block_size, stale=True, heads=heads)
    assert batch.attn_metadata.prefill is not None and batch.attn_metadata.decode is not None
    torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5)


def test_prefill_kernel_matches_torch_path(native_kernels, monkeypatch):
    # Same batches through the native kernel and the torch path (per-prompt SDPA, or padded SDPA after context).
    if not native_kernels.prefill_attention_available(64):
        pytest.skip("native prefill kernel not built here")
    for seqs in ([(0, 29), (0, 3), (0, 64)], [(5, 29), (0, 3), (31, 40)]):
        out_native, expected, _ = run_batch(seqs, 16, heads=(9, 3, 64))
        with monkeypatch.context() as patch:
            patch.setattr(kernels, "load", lambda: None)
            out_torch, _, _ = run_batch(seqs, 16, heads=(9, 3, 64))
        torch.testing.assert_close(out_native, out_torch, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(out_native, expected, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("native", [True, False], ids=["native-kernel", "torch-path"])
def test_bfloat16_pool(native, monkeypatch, request):
    # A bfloat16 model keeps a bfloat16 pool: the native kernels widen K/V as they read (decode and prefill) and
    # compute in float32; the result is rounded to bfloat16 once.
    if native:
        request.getfixturevalue("native_kernels")
    else:
        monkeypatch.setattr(kernels, "load", lambda: None)
    seqs = [(0, 37), (13, 20), (40, 1), (129, 1), (0, 2)]
    # stale NaN only for the prefill kernel: the torch code multiplies masked values by 0, and the pool never holds NaN
    stale = native and kernels.attention_path().name in attention.PREFILL_KERNEL_PATHS
    out, expected, batch = run_batch(seqs, 16, stale=stale, heads=(9, 3, 64), dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and batch.attn_metadata.prefill is not None
    torch.testing.assert_close(out.float(), expected, atol=1e-2, rtol=1e-2)


def test_kernels_refuse_malformed_inputs_and_keep_nan(native_kernels):
    native = native_kernels
    if not native.prefill_attention_available(64):
        pytest.skip("native kernels not built here")
    cache = torch.zeros(4, 16, 3, 64)
    tables, lens = torch.tensor([[0, 1]]), torch.tensor([20])
    query = torch.randn(5, 9, 64)
    path = native.AttentionPath.avx512  # prefill_attention_available: an AVX-512 build
    with pytest.raises(RuntimeError, match="query_starts"):
        native.paged_prefill_attention(query, cache, cache, tables, lens, torch.tensor([-5, 5]), 0.125, path)
    with pytest.raises(RuntimeError, match="head sizes"):
        native.paged_prefill_attention(
            query[..., :32].contiguous(), cache, cache, tables, lens, torch.tensor([0, 5]), 1, path
        )
    with pytest.raises(RuntimeError, match="outside the pool"):
        native.paged_decode_attention(query[:1].contiguous(), cache, cache, torch.tensor([[0, 9]]), lens, 0.125, path)
    with pytest.raises(RuntimeError, match="must match"):
        native.paged_decode_attention(query[:1].contiguous(), cache, cache[:2], tables, lens, 0.125, path)
    # a NaN query stays NaN (as in SDPA) instead of averaging V evenly; the other rows are untouched
    query[2, 4] = float("nan")
    out = native.paged_prefill_attention(query, cache, cache, tables, lens, torch.tensor([0, 5]), 0.125, path)
    assert out[2, 4].isnan().all() and not out[:2].isnan().any() and not out[3:].isnan().any()
    out = native.paged_decode_attention(query[2:3].contiguous(), cache, cache, tables, lens, 0.125, path)
    assert out[0, 4].isnan().all() and not out[0, :4].isnan().any()


# The native attention kernels' paths (kernels.ATTENTION_PATHS), each forced through BATCHSERVE_ATTENTION_PATH so that
# every path runs on any CPU that can run it: the bf16 dot-product path only where the CPU has avx512_bf16, the
# portable loop everywhere the kernels build.


@pytest.fixture
def force_path(monkeypatch, native_kernels):
    """force_path(path): the next attention calls take `path` (skipped where it cannot run here)."""

    def force(path: str) -> None:
        if not kernels.attention_path_runs(path):
            reason = "this CPU lacks avx512_bf16 (vdpbf16ps)" if path == "avx512_bf16" else "not built (no AVX-512)"
            pytest.skip(f"attention path {path!r} cannot run here: {reason}")
        monkeypatch.setenv("BATCHSERVE_ATTENTION_PATH", path)
        monkeypatch.setenv("BATCHSERVE_PREFILL_ATTENTION", "native")  # not SDPA, which an AMX CPU takes for bf16
        kernels.attention_path.cache_clear()
        preferred_prefill_method.cache_clear()

    kernels.attention_path.cache_clear()
    yield force
    kernels.attention_path.cache_clear()  # the next test chooses again, without the forced path
    preferred_prefill_method.cache_clear()


BF16_TOLERANCE = {"atol": 1e-2, "rtol": 1e-2}  # as test_bfloat16_pool: bf16 K/V (and bf16 weights) against float32
F32_TOLERANCE = {"atol": 2e-5, "rtol": 2e-5}  # as test_decode_kernel_model_shapes


@pytest.mark.parametrize("path", kernels.ATTENTION_PATHS)
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 128), (2, 2, 32), (8, 1, 64), (4, 2, 48)], ids=str)
@pytest.mark.parametrize("block_size", [8, 9, 16, 24])
@pytest.mark.parametrize("num_seqs", [6, 40], ids=["per-kv-head-items", "per-sequence-items"])
def test_decode_paths_bfloat16_pool(path, heads, block_size, num_seqs, force_path):
    # Every path on a bfloat16 pool, against float32 attention of the same bf16 values: contexts that end mid-tile,
    # mid-block and on odd tokens (block size 9: odd blocks mid-sequence), stale garbage (NaN included) in every
    # unwritten slot; head sizes outside 32/64/128 take the portable loop on every path.
    force_path(path)
    contexts = [0, 15, 16, 47, 130, 255]
    seqs = [(contexts[i % 6] + i // 6, 1) for i in range(num_seqs)]
    out, expected, batch = run_batch(seqs, block_size, stale=True, heads=heads, dtype=torch.bfloat16)
    assert batch.attn_metadata.prefill is None and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), expected, **BF16_TOLERANCE)


@pytest.mark.parametrize("num_seqs", [6, 40], ids=["per-kv-head-items", "per-sequence-items"])
def test_bf16_decode_is_the_same_bits_on_any_number_of_threads(num_seqs, force_path):
    # The bf16 path's threads claim work items one at a time, longest context first: which thread computes an item
    # changes with the thread count and the OS's timing, its result must not.
    force_path("avx512_bf16")
    seqs = [((37 * i) % 300, 1) for i in range(num_seqs)]
    threads = torch.get_num_threads()
    outs = []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(run_batch(seqs, 16, heads=(9, 3, 64), dtype=torch.bfloat16)[0])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


@pytest.mark.parametrize("path", kernels.ATTENTION_PATHS)
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 128), (2, 2, 32)], ids=str)
@pytest.mark.parametrize("block_size", [9, 16])
def test_prefill_paths_bfloat16_pool(path, heads, block_size, force_path):
    # Prefill chunks next to decodes on every path (on "avx2" and "portable", which have no prefill kernel, SDPA),
    # bfloat16 pool, NaN garbage in unwritten slots.
    force_path(path)
    seqs = [(0, 5), (0, 16), (0, 37), (13, 20), (40, 1), (7, 33), (16, 16), (0, 2), (100, 3)]
    out, expected, batch = run_batch(seqs, block_size, stale=True, heads=heads, dtype=torch.bfloat16)
    assert batch.attn_metadata.prefill is not None and batch.attn_metadata.decode is not None
    torch.testing.assert_close(out.float(), expected, **BF16_TOLERANCE)


@pytest.mark.parametrize("path", kernels.ATTENTION_PATHS)
def test_prefill_without_a_kernel_takes_sdpa(path, force_path, monkeypatch):
    # Where the native prefill kernel cannot run (no AVX-512: the "avx2" and "portable" paths), prefill chunks take
    # SDPA on the CPU, which the native decoder loop runs too, not the torch code that sends a step to the Python
    # layers.
    force_path(path)
    query = torch.zeros(3, 9, 64)
    cache = (torch.zeros(4, 16, 3, 64), torch.zeros(4, 16, 3, 64))
    expected = "native" if path in attention.PREFILL_KERNEL_PATHS else "sdpa"
    assert attention.prefill_method(query, 64, cache) == expected
    assert attention.prefill_method(query, 80, cache) == "sdpa"  # a head size the kernel was not built for
    monkeypatch.setenv("BATCHSERVE_NATIVE_KERNELS", "0")
    kernels.load.cache_clear()  # decided once per process, as the forced paths are
    try:
        assert attention.prefill_method(query, 64, cache) == "sdpa"
    finally:
        monkeypatch.undo()
        kernels.load.cache_clear()  # the next test loads them again (the build stays cached)


@pytest.mark.parametrize("block_size", [9, 16])
def test_torch_prefill_code(block_size, monkeypatch):
    # The torch code that prefill chunks take off the CPU (gather, pad to the longest chunk, one SDPA under the
    # prefill mask), forced here on the CPU: whole prompts, chunks after earlier context, next to decodes.
    monkeypatch.setattr(attention, "prefill_method", lambda *_: "torch")
    seqs = [(0, 5), (0, 16), (0, 37), (13, 20), (40, 1), (7, 33), (16, 16), (0, 2), (100, 3)]
    out, expected, batch = run_batch(seqs, block_size, heads=(9, 3, 64))
    assert not batch.attn_metadata.prefill.fresh
    torch.testing.assert_close(out, expected, **F32_TOLERANCE)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("block_size", [9, 16])
def test_sdpa_prefill_path(dtype, block_size, force_prefill, monkeypatch):
    # The per-sequence SDPA prefill (AMX CPUs' path for bfloat16 pools), forced on any CPU: whole prompts, chunks
    # after earlier context that starts mid-block or on a block's edge, next to decodes, NaN garbage in unwritten
    # slots; the native prefill kernel never runs.
    force_prefill("sdpa")
    monkeypatch.setattr(attention, "_native_prefill", lambda *_: pytest.fail("the native prefill kernel ran"))
    seqs = [(0, 5), (0, 16), (0, 37), (13, 20), (40, 1), (7, 33), (16, 16), (0, 2), (100, 3)]
    out, expected, batch = run_batch(seqs, block_size, stale=True, heads=(9, 3, 64), dtype=dtype)
    spans = batch.attn_metadata.prefill.spans
    assert sorted(context for *_, context in spans) == [0, 0, 0, 0, 7, 13, 16, 100]
    chunks = [seqs[int(rid[1:])] for rid in batch.req_ids if seqs[int(rid[1:])][1] > 1]  # decodes are packed first
    assert [(stop - start, context) for start, stop, context in spans] == [(n, c) for c, n in chunks]
    tolerance = BF16_TOLERANCE if dtype == torch.bfloat16 else F32_TOLERANCE
    torch.testing.assert_close(out.float(), expected, **tolerance)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("caller", ["native_step", "torch_code"])
def test_sdpa_chunk_after_context_equals_the_bool_mask(dtype, caller, force_prefill, monkeypatch):
    # A chunk after cached context attends under an additive mask made once a step, not a bool mask SDPA converts on
    # every layer's call: its rows equal, bit for bit, SDPA over its K/V under the shifted bool causal mask (native
    # step and torch code alike).
    force_prefill("sdpa")
    if caller == "torch_code":
        monkeypatch.setattr(attention, "native_step", lambda *_: None)
    seqs = [(40, 7), (16, 16), (100, 33), (0, 9), (13, 1)]
    torch.manual_seed(1)
    tensors = [tuple(torch.randn(c + n, h, 64).to(dtype) for h in (9, 3, 3)) for c, n in seqs]
    out, _, batch = run_batch(seqs, 16, stale=True, heads=(9, 3, 64), dtype=dtype, tensors=tensors)
    order = [int(r[1:]) for r in batch.req_ids]
    ends = dict(zip(order, torch.tensor([seqs[i][1] for i in order]).cumsum(0).tolist(), strict=True))
    for i, (context, n) in enumerate(seqs[:3]):  # the chunks after context (then a fresh prompt, a decode)
        q, k, v = (t.transpose(0, 1)[None] for t in tensors[i])
        mask = torch.ones(n, context + n, dtype=torch.bool).tril(context)
        expected = F.scaled_dot_product_attention(q[:, :, context:], k, v, attn_mask=mask, enable_gqa=True)
        assert torch.equal(out[ends[i] - n : ends[i]], expected[0].transpose(0, 1)), (i, context, n)


@pytest.mark.parametrize("path", kernels.ATTENTION_PATHS)
def test_paths_float32_pool(path, force_path):
    # A float32 pool on every path: float32 accuracy (the bf16 dot-product path computes it as "avx512" does).
    force_path(path)
    seqs = [(0, 5), (0, 37), (13, 20), (40, 1), (129, 1), (255, 1), (7, 1)]
    out, expected, _ = run_batch(seqs, 16, stale=True, heads=(9, 3, 64))
    torch.testing.assert_close(out, expected, **F32_TOLERANCE)


def test_bf16_dot_path_leaves_float32_pools_and_prefill_as_they_were(force_path):
    # Float32 models keep their exact results (greedy parity): on a float32 pool the avx512_bf16 path runs the very
    # code of the avx512 path, bit for bit, in decode and prefill.
    seqs = [(0, 29), (5, 1), (31, 40), (200, 1)]
    force_path("avx512")
    before, _, _ = run_batch(seqs, 16, heads=(9, 3, 64))
    force_path("avx512_bf16")
    after, _, _ = run_batch(seqs, 16, heads=(9, 3, 64))
    assert torch.equal(before, after)
    # while on a bfloat16 pool the forced path is the one that decodes; both prefill by the one widening kernel (float32
    # scores and weights: docs/cpu-kernels.md), bit for bit
    bf16_dot, _, _ = run_batch(seqs, 16, heads=(9, 3, 64), dtype=torch.bfloat16)
    force_path("avx512")
    widened, _, _ = run_batch(seqs, 16, heads=(9, 3, 64), dtype=torch.bfloat16)
    assert not torch.equal(bf16_dot[:2], widened[:2])  # the batch packs its decodes first
    assert torch.equal(bf16_dot[2:], widened[2:])


def test_bf16_dot_path_matches_the_widening_path(force_path, native_kernels):
    # The two AVX-512 paths on one bfloat16 pool, called directly: apart from the rounding of the softmax weights to
    # bf16, the same sums (well inside the bf16 tolerance); a NaN query stays NaN, as in SDPA.
    force_path("avx512_bf16")
    torch.manual_seed(0)
    cache = [torch.randn(40, 16, 3, 64).bfloat16() for _ in range(2)]
    tables = torch.randperm(40)[:36].view(4, 9)
    lens = torch.tensor([1, 17, 100, 144])
    query = torch.randn(4, 9, 64).bfloat16().float()
    wide = native_kernels.paged_decode_attention(
        query, *cache, tables, lens, 0.125, native_kernels.AttentionPath.avx512
    )
    dot = native_kernels.paged_decode_attention(
        query, *cache, tables, lens, 0.125, native_kernels.AttentionPath.avx512_bf16
    )
    torch.testing.assert_close(dot, wide, atol=4e-3, rtol=1e-2)
    assert not torch.equal(dot, wide)  # the weights are rounded to bf16 on one path only: two code paths ran
    query[2, 4] = float("nan")
    dot = native_kernels.paged_decode_attention(
        query, *cache, tables, lens, 0.125, native_kernels.AttentionPath.avx512_bf16
    )
    assert dot[2, 4].isnan().all() and not dot[2, :4].isnan().any() and not dot[[0, 1, 3]].isnan().any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_avx2_path_matches_the_portable_loop(dtype, force_path, native_kernels):
    # The AVX2 decode kernel against the plain loop on one pool, called directly: blocks of 9 (8-token tiles that
    # straddle blocks), contexts of 1 to 144, every head size it takes; a NaN query stays NaN in its head only.
    force_path("avx2")
    torch.manual_seed(0)
    lens = torch.tensor([1, 8, 9, 17, 100, 144])
    tables = torch.stack([torch.randperm(40)[:16] for _ in lens])
    for heads, kv_heads, head_dim in ((9, 3, 64), (4, 1, 128), (2, 2, 32)):
        cache = [torch.randn(40, 9, kv_heads, head_dim).to(dtype) for _ in range(2)]
        query = torch.randn(len(lens), heads, head_dim)
        avx2 = native_kernels.paged_decode_attention(
            query, *cache, tables, lens, head_dim**-0.5, native_kernels.AttentionPath.avx2
        )
        plain = native_kernels.paged_decode_attention(
            query, *cache, tables, lens, head_dim**-0.5, native_kernels.AttentionPath.portable
        )
        torch.testing.assert_close(avx2, plain, **F32_TOLERANCE)
    query[2, 1] = float("nan")
    avx2 = native_kernels.paged_decode_attention(
        query, *cache, tables, lens, head_dim**-0.5, native_kernels.AttentionPath.avx2
    )
    assert avx2[2, 1].isnan().all() and not avx2[2, 0].isnan().any() and not avx2[[0, 1, 3, 4, 5]].isnan().any()


def test_attention_path_choice(monkeypatch, native_kernels, caplog):
    # Chosen once (the best path this build and CPU run) and logged once, as the module's Isa that every
    # call takes; BATCHSERVE_ATTENTION_PATH forces one, and a path that cannot run here is an error, not a silent
    # fallback, in Python and in the kernels alike.
    paths = native_kernels.AttentionPath
    built = [p.name for p in native_kernels.attention_paths()]
    assert built[-1] == "portable" and built == [p for p in kernels.ATTENTION_PATHS if p in built]
    best = native_kernels.best_attention_path()
    assert native_kernels.attention_path_runs(best) and best.name == next(filter(kernels.attention_path_runs, built))
    assert native_kernels.attention_path_runs(paths.avx512_bf16) == native_kernels.bf16_dot_supported()
    monkeypatch.delenv("BATCHSERVE_ATTENTION_PATH", raising=False)
    try:
        kernels.attention_path.cache_clear()
        kernels._log_paths_once.cache_clear()  # the one line of every operation's path, logged at the first choice
        with caplog.at_level("INFO", logger=kernels.__name__):
            assert kernels.attention_path() == kernels.attention_path() == best
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("native kernel paths:")]
        assert len(lines) == 1 and f"attention {best.name}," in lines[0]
        for name in kernels.ATTENTION_PATHS:
            monkeypatch.setenv("BATCHSERVE_ATTENTION_PATH", name)
            kernels.attention_path.cache_clear()
            if kernels.attention_path_runs(name):
                assert kernels.attention_path() == paths.__members__[name]
            else:
                with pytest.raises(ValueError, match="not built here or not runnable"):
                    kernels.attention_path()
        monkeypatch.setenv("BATCHSERVE_ATTENTION_PATH", "fastest")
        kernels.attention_path.cache_clear()
        with pytest.raises(ValueError, match="not one of"):
            kernels.attention_path()
        cache = torch.zeros(2, 16, 3, 64)
        call = (torch.zeros(1, 9, 64), cache, cache, torch.tensor([[0]]), torch.tensor([3]), 1.0)
        with pytest.raises(TypeError):
            native_kernels.paged_decode_attention(*call, "avx2")  # a path is the enum, never a name parsed per call
        for path in (p for p in paths.__members__.values() if not native_kernels.attention_path_runs(p)):
            with pytest.raises(RuntimeError, match="not built here"):
                native_kernels.paged_decode_attention(*call, path)
    finally:
        kernels.attention_path.cache_clear()
