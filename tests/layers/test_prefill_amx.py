"""The native prefill kernels of a bfloat16 pool on 32-row tiles (kernels/prefill_tiles.h), on each of their paths:
AMX tiles ("amx", where the CPU grants them), their scalar emulation ("amx_emulated", any AVX-512 CPU) and AVX512-BF16
dot products on the vector unit ("avx512_bf16", kernels/prefill_avx512_bf16.cpp, where the CPU has avx512_bf16).
Against float64 attention of the same bf16 values, and bit for bit against itself however the rows are chunked or
batched: a prefix-cache hit's chunk must round as the whole prompt did."""

from __future__ import annotations

import pytest
import torch

from batchserve.layers import kernels
from batchserve.layers.attention import preferred_prefill_method, prefill_method
from batchserve.layers.kernels import paths

TILE_PATHS = ("amx", "amx_emulated", "avx512_bf16")
# How far from float64 each path's output may be. AMX's tiles multiply P rounded to bf16: about 2^-9 of the output's
# scale. The dot products take P as its bf16 rounding plus the remainder's (~16 bits): float32's order of error,
# which a single rounding would miss by a hundredfold (measured 1e-5 against 3e-3), plus ONE_ROUNDING's share.
TOLERANCE = {"avx512_bf16": 5e-5}
# The dot products leave a row's key block at one rounding where its largest weight is below 2^REST_BELOW of the row's
# running maximum (kRestBelow in prefill_tiles.h), so below that of the row's final maximum. Rounding to bf16 moves a
# weight by at most 2^-8 of it, so such blocks move an output by at most 2^-8 sum(p_j |v_j|) over their keys.
ONE_ROUNDING = {"avx512_bf16": -1.0}
KEY_BLOCK = 128  # keys per softmax block, aligned to position 0
NEEDS = {"amx": "AMX tiles granted to this process", "avx512_bf16": "avx512_bf16 in the CPU and the build"}


@pytest.fixture
def native():
    module = kernels.load()
    if module is None or not kernels.attention_path_runs("avx512"):
        pytest.skip("the native prefill kernels need an AVX-512 build")
    return module


def _isa(native, path: str):
    if not kernels.prefill_kernel_path_runs(path):
        needs = NEEDS.get(path, "an AVX-512 build")
        pytest.skip(f"prefill kernel path {path} is not built here or does not run on this CPU (it needs {needs})")
    return native.Isa.__members__[paths.OPERATIONS["prefill_attention"].path(path).isa]


class Pool:
    """A bf16 K/V pool holding `lens` sequences in shuffled blocks, and every position's query (bf16 values)."""

    def __init__(self, lens, heads, kv_heads, head_dim, block_size, seed=0):
        gen = torch.Generator().manual_seed(seed)
        self.lens, self.heads, self.head_dim = list(lens), heads, head_dim
        max_blocks = max(-(-n // block_size) for n in lens)
        num_blocks = max_blocks * len(lens) + 3
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.key = (torch.randn(shape, generator=gen) * 2).to(torch.bfloat16)
        self.value = torch.randn(shape, generator=gen).to(torch.bfloat16)
        order = torch.randperm(num_blocks, generator=gen)[: max_blocks * len(lens)]
        self.tables = order.view(len(lens), max_blocks).to(torch.int64)
        self.queries = [torch.randn(n, heads, head_dim, generator=gen).to(torch.bfloat16).float() for n in lens]
        self.block_size = block_size

    def run(self, native, isa, chunks, scale=None, dtype=torch.float32):
        """The kernel over the last `chunks[i]` rows of sequence i, queries in `dtype` -> [rows, H, D] in `dtype`."""
        query = torch.cat([q[n - c :] for q, n, c in zip(self.queries, self.lens, chunks)]).to(dtype)
        starts = torch.tensor([0, *chunks]).cumsum(0)
        scale = scale if scale is not None else self.head_dim**-0.5
        lens = torch.tensor(self.lens, dtype=torch.int64)
        path = native.Isa.avx512_bf16 if kernels.attention_path_runs("avx512_bf16") else native.Isa.avx512
        return native.paged_prefill_attention(query, self.key, self.value, self.tables, lens, starts, scale, path, isa)

    def weights_and_values(self, seq, chunk, scale=None):
        """float64 softmax weights of sequence `seq`'s last `chunk` rows [H, chunk, n], and its values [n, H, D]."""
        n, scale = self.lens[seq], scale if scale is not None else self.head_dim**-0.5
        slots = (self.tables[seq, :, None] * self.block_size + torch.arange(self.block_size)).reshape(-1)[:n]
        flat = self.key.shape[1] * self.key.shape[0]
        keys = self.key.reshape(flat, *self.key.shape[2:])[slots].double()  # [n, Hkv, D]
        values = self.value.reshape(flat, *self.value.shape[2:])[slots].double()
        group = self.heads // keys.shape[1]
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
        q = self.queries[seq][n - chunk :].double()
        scores = torch.einsum("qhd,khd->hqk", q, keys) * scale
        positions = torch.arange(n - chunk, n)
        scores = scores.masked_fill(torch.arange(n)[None, :] > positions[:, None], float("-inf"))
        return scores.softmax(-1), values

    def reference(self, seq, chunk, scale=None):
        """float64 causal attention of sequence `seq`'s last `chunk` rows -> [chunk, H, D]."""
        weights, values = self.weights_and_values(seq, chunk, scale)
        return torch.einsum("hqk,khd->qhd", weights, values)

    def one_rounding_bound(self, seq, chunk, below, scale=None):
        """How far one rounding of the weights may move each output [chunk, H, D]: 2^-8 sum(p_j |v_j|) over the keys
        of the key blocks whose largest weight for the row is below 2^below of the row's largest (1% slack for the
        kernel's float32 scores)."""
        weights, values = self.weights_and_values(seq, chunk, scale)
        n = weights.shape[-1]
        blocks = torch.nn.functional.pad(weights, (0, -n % KEY_BLOCK)).unflatten(-1, (-1, KEY_BLOCK))
        small = blocks.amax(-1) < 2.0**below * 1.01 * weights.amax(-1, keepdim=True)
        rounded = weights * small.repeat_interleave(KEY_BLOCK, -1)[..., :n]
        return 2.0**-8 * torch.einsum("hqk,khd->qhd", rounded, values.abs())


def assert_near_float64(path, out, pool, chunks):
    """out (the kernel's rows of `pool`'s last `chunks` rows) within the path's tolerance of float64 attention, plus
    what its one rounding may move where the path takes it."""
    expected = torch.cat([pool.reference(i, c) for i, c in enumerate(chunks)])
    tolerance = TOLERANCE.get(path, 1.5e-2)
    if path not in ONE_ROUNDING:
        return torch.testing.assert_close(out.double(), expected, atol=tolerance, rtol=tolerance)
    below = ONE_ROUNDING[path]
    bound = torch.cat([pool.one_rounding_bound(i, c, below) for i, c in enumerate(chunks)])
    allowed = tolerance * (1 + expected.abs()) + bound
    excess = (out.double() - expected).abs() - allowed
    assert excess.max() <= 0, (
        f"{excess.max():.3g} past the bound at {divmod(int(excess.argmax()), expected[0].numel())}"
    )


SHAPES = [(9, 3, 64), (4, 1, 128), (2, 2, 32), (8, 1, 64), (4, 4, 128)]


@pytest.mark.parametrize("path", TILE_PATHS)
@pytest.mark.parametrize("heads", SHAPES, ids=str)
@pytest.mark.parametrize("block_size", [9, 16])
def test_matches_float64_attention(path, heads, block_size, native):
    # odd lengths, a context ending mid key tile and mid block; whole prompts and chunks after earlier context
    pool = Pool([1, 33, 130, 257], *heads, block_size, seed=block_size)
    isa = _isa(native, path)
    for chunks in ([1, 33, 130, 257], [1, 5, 97, 31]):
        assert_near_float64(path, pool.run(native, isa, chunks), pool, chunks)


@pytest.mark.parametrize("path", TILE_PATHS)
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 1, 128)], ids=str)
def test_a_chunk_after_context_is_bit_equal_to_the_whole_prompt(path, heads, native):
    # key tiles aligned to position 0: a row rounds the same whatever rows share its tile or where its chunk began
    pool = Pool([300], *heads, 16, seed=1)
    isa = _isa(native, path)
    whole = pool.run(native, isa, [300])
    for chunk in (1, 2, 31, 32, 33, 100, 127, 128, 129, 299):
        assert torch.equal(pool.run(native, isa, [chunk]), whole[300 - chunk :]), chunk


@pytest.mark.parametrize("path", TILE_PATHS)
def test_a_maximum_that_grows_block_after_block_rounds_the_same_in_any_chunk(path, native):
    # keys growing along the prompt: a row's running maximum rises in most of its key blocks, so its accumulator is
    # rescaled there (and left alone where the maximum held), in blocks whole for the row and in its last one alike
    pool = Pool([520], 4, 2, 64, 16, seed=6)
    growth = torch.ones(pool.key.shape[0])
    growth[pool.tables[0]] = torch.linspace(0.5, 4.0, pool.tables.shape[1])
    pool.key = (pool.key.float() * growth[:, None, None, None]).to(torch.bfloat16)
    isa = _isa(native, path)
    whole = pool.run(native, isa, [520])
    assert_near_float64(path, whole, pool, [520])
    for chunk in (1, 129, 300, 519):
        assert torch.equal(pool.run(native, isa, [chunk]), whole[520 - chunk :]), chunk


def test_a_long_row_leaves_its_far_blocks_at_one_rounding_within_the_bound(native):
    # 2,200 keys spread wide (scores' standard deviation ~4): most of a late row's key blocks lie far below its maximum,
    # so the dot products multiply their weights once. The error stays within the derived bound, the skip is in force
    # (past what the remainders everywhere leave, ~1e-5), and the row's bits do not depend on its chunk.
    pool = Pool([2200], 4, 1, 64, 16, seed=7)
    pool.key = (pool.key.float() * 2).to(torch.bfloat16)
    isa = _isa(native, "avx512_bf16")
    weights, _ = pool.weights_and_values(0, 256)
    blocks = torch.nn.functional.pad(weights, (0, -2200 % KEY_BLOCK)).unflatten(-1, (-1, KEY_BLOCK))
    far = blocks.amax(-1) < 2.0 ** ONE_ROUNDING["avx512_bf16"] * weights.amax(-1, keepdim=True)
    assert far.double().mean() > 0.5
    out = pool.run(native, isa, [256])
    assert_near_float64("avx512_bf16", out, pool, [256])
    assert (out.double() - pool.reference(0, 256)).abs().max() > TOLERANCE["avx512_bf16"]
    whole = pool.run(native, isa, [2200])
    for chunk in (1, 100, 256):
        assert torch.equal(pool.run(native, isa, [chunk]), whole[2200 - chunk :]), chunk


@pytest.mark.parametrize("path", TILE_PATHS)
def test_a_row_is_the_same_bits_in_any_batch_and_on_any_number_of_threads(path, native):
    pool = Pool([70, 200, 45], 6, 2, 64, 16, seed=2)
    isa = _isa(native, path)
    together = pool.run(native, isa, [70, 17, 45])
    alone = Pool([200], 6, 2, 64, 16, seed=2)
    alone.key, alone.value, alone.tables = pool.key, pool.value, pool.tables[1:2]
    alone.queries = pool.queries[1:2]
    assert torch.equal(alone.run(native, isa, [17]), together[70:87])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(pool.run(native, isa, [70, 17, 45]), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("path", TILE_PATHS)
def test_bf16_rows_are_the_float32_rows_rounded(path, native):
    # bf16 queries go in as they are and come out rounded to nearest even: the float32 output's bits, rounded
    pool = Pool([90, 33], 6, 2, 64, 16, seed=5)
    isa = _isa(native, path)
    out = pool.run(native, isa, [90, 7], dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and torch.equal(out, pool.run(native, isa, [90, 7]).bfloat16())
    with pytest.raises(RuntimeError, match="bfloat16"):  # the vector kernel takes float32 queries only
        pool.run(native, native.Isa.avx512, [90, 7], dtype=torch.bfloat16)


def test_amx_tiles_and_their_emulation_agree(native):
    pool = Pool([150, 40], 8, 2, 128, 16, seed=3)
    on_tiles = pool.run(native, _isa(native, "amx"), [150, 40])
    emulated = pool.run(native, _isa(native, "amx_emulated"), [150, 40])
    torch.testing.assert_close(on_tiles, emulated, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("path", ["amx_emulated", "avx512_bf16"])
def test_the_vector_kernel_still_takes_a_float32_pool_on_the_tile_paths(path, native):
    pool = Pool([50], 4, 2, 64, 16, seed=4)
    expected = pool.reference(0, 50)
    pool.key, pool.value = pool.key.float(), pool.value.float()
    out = pool.run(native, _isa(native, path), [50])
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)


def test_auto_takes_the_tiles_for_a_bf16_pool_where_they_were_measured(native, force_prefill_kernel, monkeypatch):
    monkeypatch.delenv("BATCHSERVE_PREFILL_ATTENTION", raising=False)
    if "amx_bf16" not in kernels.cpu_flags().split():
        pytest.skip("prefill auto prefers the tiles only on a CPU with AMX")
    force_prefill_kernel("amx_emulated")
    like = torch.empty(1, dtype=torch.bfloat16)
    pool = (torch.empty(1, 16, 1, 64, dtype=torch.bfloat16),) * 2
    assert preferred_prefill_method(torch.bfloat16) == "native"
    assert prefill_method(like, 64, pool) == "native"
    assert prefill_method(like, 32, pool) == "sdpa"  # not measured faster than SDPA: SDPA
    assert prefill_method(like, 32, pool, "native") == "native"  # asked for: the kernel
    force_prefill_kernel("avx512")  # the tiles not taken: SDPA on AMX, as before
    assert preferred_prefill_method(torch.bfloat16) == "sdpa"


def test_a_path_that_cannot_run_is_refused_by_name(native, monkeypatch):
    monkeypatch.setenv("BATCHSERVE_PREFILL_KERNEL_PATH", "tiles")
    kernels.prefill_kernel_path.cache_clear()
    try:
        with pytest.raises(ValueError, match="BATCHSERVE_PREFILL_KERNEL_PATH='tiles'"):
            kernels.prefill_kernel_path()
    finally:
        monkeypatch.delenv("BATCHSERVE_PREFILL_KERNEL_PATH")
        kernels.prefill_kernel_path.cache_clear()
