"""The 8-bit KV caches (int8, fp8_e4m3): quantize/dequantize round trips, attention over a quantized pool on every
forced path (decode, prefill, chunked prefill), pool sizing, and swap/resize moving the scales with the blocks."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from batchserve.config import CacheConfig, ConfigError, ModelConfig
from batchserve.core.outputs import NewRequestData, SchedulerOutput
from batchserve.layers import kernels, kv_quant
from batchserve.layers.attention import paged_attention, preferred_prefill_method
from batchserve.sampling_params import SamplingParams
from batchserve.worker import kv_cache as kv_module
from batchserve.worker.input_batch import RequestTable
from batchserve.worker.kv_cache import KVCache, block_bytes, num_blocks_for_budget, pool_dtype

CPU = torch.device("cpu")
SMOLLM2_SHAPES = ModelConfig(  # SmolLM2-135M's KV shapes: 30 layers, 3 KV heads of 64
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
    head_dim=64, max_position_embeddings=8192,
)  # fmt: skip


FP8 = torch.float8_e4m3fn
CODES = [torch.int8, FP8]


def test_float8_round_trip_error_is_within_its_three_mantissa_bits():
    """e4m3 keeps 3 mantissa bits: an element is off by at most 1/16 of its magnitude, or half the smallest step
    (2^-9 x the scale) near zero; the row's largest element maps to 448 exactly."""
    torch.manual_seed(1)
    x = torch.randn(257, 3, 64) * torch.logspace(-3, 2, 257)[:, None, None]
    x[5] = 0.0
    q, scale = kv_quant.quantize(x, FP8)
    assert q.dtype == FP8 and scale.shape == (257, 3)
    assert float(q.float().abs().max()) == 448.0
    back = kv_quant.dequantize(q, scale)
    assert torch.equal(back[5], torch.zeros_like(back[5]))
    bound = x.abs() / 16 + scale.unsqueeze(-1) * 2.0**-10
    assert bool(((back - x).abs() <= bound * (1 + 1e-6)).all())
    assert not bool(((back - x).abs() <= x.abs() / 64).all())  # coarser than int8's grid: not a tighter bound
    assert torch.equal(kv_quant.quantize(back, FP8)[0].float(), q.float())  # the grid is a fixed point


def test_round_trip_error_is_at_most_half_a_step():
    torch.manual_seed(0)
    x = torch.randn(257, 3, 64) * torch.logspace(-3, 2, 257)[:, None, None]  # rows over five decades of magnitude
    x[5] = 0.0  # an all-zero row: its scale must not divide by zero
    q, scale = kv_quant.quantize(x)
    assert q.dtype == torch.int8 and scale.shape == (257, 3)
    assert int(q.abs().max()) == 127  # the largest element of each row uses the whole range
    back = kv_quant.dequantize(q, scale)
    assert torch.equal(back[5], torch.zeros_like(back[5]))
    error = (back - x).abs()
    assert bool((error <= scale.unsqueeze(-1) * 0.5 * (1 + 1e-5)).all())
    relative = error.amax(-1) / x.abs().amax(-1).clamp_min(1e-30)
    assert float(relative.max()) <= 0.5 / 127 + 1e-6
    assert torch.equal(kv_quant.quantize(back)[0], q)  # the grid is a fixed point


def _reference(q, k, v, query_len):
    """Causal float32 attention over a whole sequence [L, H, D]; its last query_len rows."""
    group = q.shape[1] // k.shape[1]
    q, k, v = (t.transpose(0, 1)[None] for t in (q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)[0].transpose(0, 1)[-query_len:]


def _step(states, new_reqs, scheduled):
    out = SchedulerOutput(new_requests=new_reqs, num_scheduled_tokens=scheduled)
    states.apply(out)
    return states.build(out, CPU)


def run_quantized_batch(
    seqs, block_size, heads=(6, 2, 64), seed=0, dtype=torch.float32, code=torch.int8, spread: float = 0.0
):
    """seqs: (tokens cached by an earlier step, tokens this step), on a pool of `code` codes, q/k/v in dtype ->
    (output, the float32 attention over the dequantized K/V, the same over the exact K/V). spread: each element's
    magnitude also times e^(spread x a normal sample), so that a row holds values far below its largest (float8's
    subnormal codes)."""
    num_heads, num_kv_heads, head_dim = heads
    torch.manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in seqs) + 2
    pool = kv_quant.QuantizedKV.zeros((num_blocks, block_size, num_kv_heads, head_dim), CPU, dtype=code)
    free = list(range(num_blocks))
    rng.shuffle(free)
    full, new_reqs, earlier = [], [], []
    for i, (cached, n) in enumerate(seqs):
        length = cached + n
        blocks = [free.pop() for _ in range(-(-length // block_size))]
        shapes = [(length, h, head_dim) for h in (num_heads, num_kv_heads, num_kv_heads)]
        full.append(tuple((torch.randn(s) * torch.exp(spread * torch.randn(s))).to(dtype) for s in shapes))
        new_reqs.append(NewRequestData(f"r{i}", list(range(length)), length, SamplingParams(), blocks, cached))
        earlier.append(NewRequestData(f"r{i}", list(range(length)), length, SamplingParams(), blocks, 0))
    cached_counts = {f"r{i}": c for i, (c, _) in enumerate(seqs) if c > 0}
    if cached_counts:  # the cached part, written by an earlier step
        batch = _step(RequestTable(block_size), earlier, cached_counts)
        ids = [int(r[1:]) for r in batch.req_ids]
        q, k, v = (torch.cat([full[i][t][: seqs[i][0]] for i in ids]) for t in range(3))
        paged_attention(q, k, v, pool, batch.attn_metadata)
    batch = _step(RequestTable(block_size), new_reqs, {f"r{i}": n for i, (_, n) in enumerate(seqs)})
    order = [int(r[1:]) for r in batch.req_ids]
    q, k, v = (torch.cat([full[i][t][seqs[i][0] :] for i in order]) for t in range(3))
    out = paged_attention(q, k, v, pool, batch.attn_metadata)

    def round_trip(x):
        return kv_quant.dequantize(*kv_quant.quantize(x, code))

    full = [tuple(t.float() for t in parts) for parts in full]
    dequantized = [_reference(q, round_trip(k), round_trip(v), seqs[i][1]) for i, (q, k, v) in enumerate(full)]
    exact = [_reference(*full[i], seqs[i][1]) for i in range(len(seqs))]
    return out, torch.cat([dequantized[i] for i in order]), torch.cat([exact[i] for i in order])


@pytest.fixture(params=["torch", *kernels.ATTENTION_PATHS])
def attention_path(request, monkeypatch):
    """Each CPU attention path forced (as tests/layers/test_attention.py forces them), and the torch code alone."""
    if request.param == "torch":
        monkeypatch.setattr(kernels, "load", lambda: None)
    else:
        if kernels.load() is None or not kernels.attention_path_runs(request.param):
            pytest.skip(f"attention path {request.param!r} cannot run here")
        monkeypatch.setenv("BATCHSERVE_ATTENTION_PATH", request.param)
        monkeypatch.setenv("BATCHSERVE_PREFILL_ATTENTION", "native")
    kernels.attention_path.cache_clear()
    preferred_prefill_method.cache_clear()
    yield request.param
    kernels.attention_path.cache_clear()
    preferred_prefill_method.cache_clear()


SEQS = {
    "decode": [(9, 1), (30, 1), (0, 1), (15, 1)],
    "prefill": [(0, 13), (0, 5), (0, 21)],
    "chunked-prefill+decode": [(20, 7), (11, 1), (0, 9), (16, 1), (3, 16)],
}


@pytest.mark.parametrize("code", CODES, ids=str)
@pytest.mark.parametrize("block_size", [8, 16])
@pytest.mark.parametrize("seqs", list(SEQS.values()), ids=list(SEQS))
def test_quantized_pool_attention_equals_float32_over_the_dequantized_cache(seqs, block_size, code, attention_path):
    out, over_dequantized, exact = run_quantized_batch(seqs, block_size, code=code)
    # What the pool stores, attended in float32: the only difference left is the order of the float sums.
    torch.testing.assert_close(out, over_dequantized, atol=1e-5, rtol=1e-5)
    # Against the exact K/V: |V error| <= s/2 <= max|v| / 254 per element (the weights sum to 1); the K error moves
    # each logit by at most |q|_1 * max|k| / 254 / sqrt(D), a few hundredths here, which bounds the shift in weights.
    # float8 e4m3's elements are off by up to 1/16 of themselves: some ten times int8's.
    assert float((out - exact).abs().max()) < (0.05 if code == torch.int8 else 0.5)


def test_pool_dtype_names():
    assert pool_dtype(CacheConfig(kv_cache_dtype="int8"), torch.bfloat16) == torch.int8
    assert pool_dtype(CacheConfig(kv_cache_dtype="auto"), torch.bfloat16) == torch.bfloat16
    assert pool_dtype(CacheConfig(kv_cache_dtype="float32"), torch.bfloat16) == torch.float32
    assert pool_dtype(CacheConfig(kv_cache_dtype="fp8_e4m3"), torch.bfloat16) == FP8
    CacheConfig(kv_cache_dtype="fp8_e4m3").validate()
    with pytest.raises(ConfigError, match="kv_cache_dtype must be one of"):
        CacheConfig(kv_cache_dtype="int4").validate()


def test_int8_pool_holds_about_twice_the_blocks_of_bfloat16(monkeypatch):
    budget = 3 * 1024**3
    monkeypatch.setattr(kv_module, "available_memory_bytes", lambda device: budget)
    config = CacheConfig(kv_cache_memory_fraction=1.0)
    bf16 = num_blocks_for_budget(config, SMOLLM2_SHAPES, torch.bfloat16, CPU)
    int8 = num_blocks_for_budget(config, SMOLLM2_SHAPES, torch.int8, CPU)
    # per slot and head: 64 int8 + a float32 scale = 68 bytes against bf16's 128
    assert block_bytes(SMOLLM2_SHAPES, 16, torch.int8) * 128 == block_bytes(SMOLLM2_SHAPES, 16, torch.bfloat16) * 68
    assert int8 == budget // block_bytes(SMOLLM2_SHAPES, 16, torch.int8)
    assert 1.85 < int8 / bf16 < 1.9
    assert block_bytes(SMOLLM2_SHAPES, 16, FP8) == block_bytes(SMOLLM2_SHAPES, 16, torch.int8)


@pytest.mark.parametrize("code", CODES, ids=str)
def test_swap_and_resize_move_the_scales_with_the_blocks(code):
    shapes = ModelConfig(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=1,
                         head_dim=8, max_position_embeddings=64)  # fmt: skip
    cache = KVCache.allocate(shapes, num_blocks=4, num_swap_blocks=3, block_size=8, dtype=code, device=CPU)
    assert all(kv_quant.is_quantized(layer) for layer in cache.device_caches + cache.host_caches)
    torch.manual_seed(1)
    written = []
    for layer in cache.device_caches:
        k, v = torch.randn(2, 4 * 8, 1, 8)
        kv_quant.write(k, v, layer, torch.arange(32))
        written.append(tuple(t.clone() for t in kv_quant.dequantized_pool(layer)))
    cache.swap_out([(2, 0), (1, 2)])
    for layer in cache.device_caches:
        for t in layer.parts():
            t.zero_()
    cache.swap_in([(3, 0), (0, 2)])
    cache.resize(6, keep_block_ids=[0, 3])
    for layer, (k, v) in zip(cache.device_caches, written, strict=True):
        k_now, v_now = kv_quant.dequantized_pool(layer)
        assert torch.equal(k_now[3], k[2]) and torch.equal(v_now[0], v[1])
        assert torch.equal(k_now[4:], torch.zeros_like(k_now[4:]))


@pytest.mark.parametrize("code", CODES, ids=str)
@pytest.mark.parametrize("path", kernels.ATTENTION_PATHS)
def test_native_decode_reads_the_codes_in_place(native_kernels, path, code, monkeypatch):
    """On each attention path (AVX-512: the vectorized decode kernel on the codes; else the plain loop)."""
    if not kernels.attention_path_runs(path):
        pytest.skip(f"attention path {path!r} cannot run here")
    monkeypatch.setenv("BATCHSERVE_ATTENTION_PATH", path)
    kernels.attention_path.cache_clear()
    torch.manual_seed(2)
    pool = kv_quant.QuantizedKV.zeros((12, 8, 3, 64), CPU, dtype=code)
    keys_in = torch.randn(96, 3, 64) * 4
    keys_in[7, 1, :60] = 1e-4  # beside a larger element: float8 subnormal codes, which the kernels widen too
    kv_quant.write(keys_in, torch.randn(96, 3, 64), pool, torch.arange(96))
    tables, lens = torch.randperm(12)[:8].view(2, 4), torch.tensor([29, 3])
    query = torch.randn(2, 9, 64)
    out = kv_quant.native_decode(query, pool, tables, lens, 0.125)
    assert out is not None
    keys, values = kv_quant.dequantized_pool(pool)
    for b in range(2):
        n = int(lens[b])
        k, v = (t[tables[b]].reshape(-1, 3, 64)[:n].repeat_interleave(3, 1).transpose(0, 1) for t in (keys, values))
        expected = F.scaled_dot_product_attention(query[b][:, None], k, v, scale=0.125)[:, 0]
        torch.testing.assert_close(out[b], expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="block id outside the pool"):
        kv_quant.native_decode(query, pool, tables + 100, lens, 0.125)
    kernels.attention_path.cache_clear()


# head size 64: the AVX-512 quantizers and decode kernels; 24: the scalar quantizer and the plain decode loop
@pytest.mark.parametrize("heads", [(6, 2, 64), (4, 2, 24)], ids=["d64", "d24"])
@pytest.mark.parametrize("code", CODES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seqs", list(SEQS.values()), ids=list(SEQS))
@pytest.mark.parametrize("spread", [0.0, 3.0], ids=["normal", "wide"])
def test_native_step_on_a_quantized_pool_equals_the_torch_path(
    seqs, dtype, code, heads, spread, monkeypatch, native_kernels
):
    """The native step (kernels/kv_quantized.cpp quantizing and storing, the in-place decode, SDPA over the blocks
    dequantized), which the native decoder loop runs, gives the torch path's output bit for bit: the same codes and
    scales stored, so a model's tokens do not depend on which of the two ran a step."""
    from batchserve.layers import attention

    calls = []
    step_attention = native_kernels.paged_attention
    monkeypatch.setattr(native_kernels, "paged_attention", lambda *a, **kw: calls.append(1) or step_attention(*a, **kw))
    native, _, _ = run_quantized_batch(seqs, 16, heads=heads, dtype=dtype, code=code, spread=spread)
    assert calls  # the native step ran
    monkeypatch.setattr(attention, "_make_native_step", lambda *args: None)
    torch_path, _, _ = run_quantized_batch(seqs, 16, heads=heads, dtype=dtype, code=code, spread=spread)
    assert native.dtype == dtype
    assert torch.equal(native, torch_path)
