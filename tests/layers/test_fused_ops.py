"""The native fused ops against the torch code they replace (the model's fallback path)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from batchserve.layers import kernels
from batchserve.layers.linear import CpuLinear
from batchserve.layers.norm import RMSNorm
from batchserve.layers.rotary import apply_rope


@pytest.mark.parametrize("rows", [1, 7, 64, 300])
def test_rms_norm_with_and_without_residual(rows, native_kernels):
    native = native_kernels
    torch.manual_seed(rows)
    x, residual, weight = torch.randn(rows, 576) * 3, torch.randn(rows, 576), torch.rand(576) + 0.5
    torch.testing.assert_close(native.rms_norm(x, None, weight, 1e-5), F.rms_norm(x, (576,), weight, 1e-5))
    expected_sum = x + residual
    out = native.rms_norm(x, residual, weight, 1e-5)
    torch.testing.assert_close(residual, expected_sum)  # the residual stream, updated in place
    torch.testing.assert_close(out, F.rms_norm(expected_sum, (576,), weight, 1e-5))


@pytest.mark.parametrize("rows, inter", [(1, 1536), (64, 1536), (129, 40)])
def test_silu_and_mul(rows, inter, native_kernels):
    native = native_kernels
    gate_up = torch.randn(rows, 2 * inter) * 6  # wide range: exp's clamps and both silu tails
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -90.0])
    expected = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    torch.testing.assert_close(native.silu_and_mul(gate_up), expected, rtol=1e-6, atol=1e-6)


def test_rope_in_place_on_a_strided_view(native_kernels):
    native = native_kernels
    torch.manual_seed(0)
    tokens, heads, kv_heads, dim = 37, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    qk = qkv[:, : (heads + kv_heads) * dim].view(tokens, heads + kv_heads, dim)  # rows strided as in the model
    angles = torch.rand(tokens, dim // 2) * 100
    cos, sin = angles.cos(), angles.sin()
    x1, x2 = qk.clone().chunk(2, dim=-1)
    expected = torch.cat((x1 * cos[:, None] - x2 * sin[:, None], x2 * cos[:, None] + x1 * sin[:, None]), dim=-1)
    v_before = qkv[:, (heads + kv_heads) * dim :].clone()
    native.rope_(qk, cos, sin)
    torch.testing.assert_close(qk, expected)
    assert torch.equal(qkv[:, (heads + kv_heads) * dim :], v_before)  # V untouched


@pytest.mark.parametrize("rows, vocab", [(1, 49152), (5, 1000), (64, 49152), (3, 7)])
def test_argmax_rows_matches_torch(rows, vocab, native_kernels):
    native = native_kernels
    torch.manual_seed(rows)
    logits = torch.randn(rows, vocab)
    logits[0, vocab // 3] = logits[0, vocab // 2] = 1e9  # a tie: the first index wins
    if rows > 2:
        logits[1, 5 % vocab] = logits[1, vocab - 1] = float("nan")  # NaN counts as the largest, the first one
        logits[2] = float("-inf")
    assert torch.equal(native.argmax_rows(logits), logits.argmax(dim=-1))


def test_write_kv_matches_index_copy(native_kernels):
    native = native_kernels
    torch.manual_seed(0)
    tokens, heads, kv_heads, dim = 11, 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    key = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)  # strided rows, as in the model
    value = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    caches = [torch.randn(6, 4, kv_heads, dim) for _ in range(2)]
    caches += [c.clone() for c in caches]
    slots = torch.randperm(24)[:tokens]
    native.write_kv_(key, value, caches[0], caches[1], slots)
    caches[2].view(-1, kv_heads, dim).index_copy_(0, slots, key)
    caches[3].view(-1, kv_heads, dim).index_copy_(0, slots, value)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])
    with pytest.raises(RuntimeError, match="outside the pool"):
        native.write_kv_(key, value, caches[0], caches[1], torch.full((tokens,), 24))


def test_model_layers_take_the_same_values_either_way(native_kernels, monkeypatch):
    # RMSNorm / MLP / RoPE helpers: native and torch paths agree.
    torch.manual_seed(1)
    norm = RMSNorm(64, 1e-6)
    norm.weight.data = torch.rand(64) + 0.5
    x, residual = torch.randn(5, 64), torch.randn(5, 64)
    fast_out, fast_res = norm(x, residual.clone())
    fast_plain = norm(x)
    angles = torch.rand(5, 8)
    rot_in = torch.randn(5, 2, 16)
    fast_rope = apply_rope(rot_in.clone(), angles.cos(), angles.sin())
    monkeypatch.setattr(kernels, "load", lambda: None)
    slow_out, slow_res = norm(x, residual.clone())
    torch.testing.assert_close(fast_out, slow_out)
    torch.testing.assert_close(fast_res, slow_res)
    torch.testing.assert_close(fast_plain, norm(x))
    torch.testing.assert_close(fast_rope, apply_rope(rot_in.clone(), angles.cos(), angles.sin()))


SMALL_PATHS = ["avx512", "avx2"]


def _check_small_gemm(native, path: str, m: int, n: int, k: int, tol: float) -> None:
    if path not in native.small_gemm_paths():
        pytest.skip(f"the {path} small-M GEMM is not built here (this CPU lacks its ISA)")
    torch.manual_seed(m * 7919 + k)
    w, x = torch.randn(n, k), torch.randn(m, k)
    packed = native.small_gemm_pack(w, path)
    width = {"avx512": 32, "avx2": 16}[path]  # two vectors' width of output columns
    padded = torch.cat([w, torch.zeros(-n % width, k)])
    assert torch.equal(packed, padded.view(-1, width, k).transpose(1, 2))  # panels [K][width], zero-padded
    out = native.small_gemm(x, packed, n)
    assert out.shape == (m, n)
    torch.testing.assert_close(out, x @ w.t(), rtol=tol, atol=tol)


@pytest.mark.parametrize("path", SMALL_PATHS)
@pytest.mark.parametrize("m", [1, 2, 5, 6, 7, 12, 13, 25, 48])
@pytest.mark.parametrize("n, k", [(960, 576), (70, 33)])  # 70: a padded last panel; 33: odd K
def test_small_gemm_matches_matmul(path, m, n, k, native_kernels):
    _check_small_gemm(native_kernels, path, m, n, k, 1e-4)


@pytest.mark.parametrize("path", SMALL_PATHS)
@pytest.mark.parametrize("m, n, k", [(13, 70, 2560), (50, 64, 8192), (400, 40, 385), (1100, 24, 700)])
def test_small_gemm_partial_depth_slices_and_row_chunks(path, m, n, k, native_kernels):
    """K past one slice with a partial last slice (accumulating), and M past one row chunk (400 rows at K=385 on
    AVX-512, 1100 rows at K=700 on AVX2)."""
    _check_small_gemm(native_kernels, path, m, n, k, 2e-3)


@pytest.mark.parametrize("path", SMALL_PATHS)
@pytest.mark.parametrize("m", [1, 4, 7, 13, 64, 128, 200])
@pytest.mark.parametrize("n, k", [(576, 576), (70, 33), (96, 1536)])  # 70: a padded last panel; 33: odd K
def test_panel_brgemm_matches_matmul_and_splits_without_changing_a_bit(path, m, n, k, native_kernels):
    """oneDNN's brgemm micro-kernel on the small-M kernel's panels (kernels/panel_brgemm.cpp) computes x @ W, and a
    panel's sums run in one order whichever thread takes it: one thread and two give the same bits."""
    if path not in native_kernels.small_gemm_paths():
        pytest.skip(f"the {path} small-M GEMM is not built here (this CPU lacks its ISA)")
    torch.manual_seed(m * 31 + n + k)
    w, x = torch.randn(n, k), torch.randn(m, k)
    packed = native_kernels.small_gemm_pack(w, path)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        out = native_kernels.panel_brgemm(x, packed, n)
        torch.set_num_threads(1)
        alone = native_kernels.panel_brgemm(x, packed, n)
    finally:
        torch.set_num_threads(threads)
    assert out.shape == (m, n) and out.is_contiguous()
    torch.testing.assert_close(out, x @ w.t(), rtol=1e-4, atol=1e-4 * max(1, k // 256))
    assert torch.equal(out, alone)


def test_panel_brgemm_rejects_a_column_count_its_panels_do_not_hold(native_kernels):
    packed = native_kernels.small_gemm_pack(torch.randn(64, 8), native_kernels.small_gemm_paths()[0])
    with pytest.raises(RuntimeError, match="column count"):
        native_kernels.panel_brgemm(torch.randn(2, 8), packed, 65)


def test_small_gemm_rejects_panels_of_no_path(native_kernels):
    with pytest.raises(RuntimeError, match="small_gemm path"):
        native_kernels.small_gemm_pack(torch.randn(8, 8), "avx1024")
    with pytest.raises(RuntimeError, match="no path's"):
        native_kernels.small_gemm(torch.randn(2, 8), torch.randn(1, 8, 24), 24)


@pytest.mark.parametrize("path", [*SMALL_PATHS, "library"])
def test_cpu_linear_layouts_agree_at_every_m(path, force_small_gemm):
    # Whatever kernel CpuLinear picks for M, the result is the Linear's.
    force_small_gemm(path)
    torch.manual_seed(3)
    for out_features in (96, 2048):  # a narrow and a wide projection
        linear = torch.nn.Linear(64, out_features, bias=True)
        cpu = CpuLinear.from_linear(linear)
        assert (cpu.small_packed is None) == (path == "library")
        for m in (1, 2, 8, 48, 49, 64, 65, 256, 257, 384, 385, 511, 512, 600):
            x = torch.randn(m, 64)
            torch.testing.assert_close(cpu(x), linear(x), rtol=1e-4, atol=1e-4)


def test_a_forced_small_gemm_path_must_exist_and_run_here(monkeypatch):
    monkeypatch.setenv("BATCHSERVE_SMALL_GEMM_PATH", "avx1024")
    kernels.small_gemm_path.cache_clear()
    try:
        with pytest.raises(ValueError, match="not one of auto"):
            kernels.small_gemm_path()
        missing = next((p for p in SMALL_PATHS if not kernels.small_gemm_path_runs(p)), None)
        if missing is not None:
            monkeypatch.setenv("BATCHSERVE_SMALL_GEMM_PATH", missing)
            kernels.small_gemm_path.cache_clear()
            with pytest.raises(ValueError, match="not built here"):
                kernels.small_gemm_path()
        monkeypatch.setenv("BATCHSERVE_SMALL_GEMM_PATH", "auto")
        kernels.small_gemm_path.cache_clear()
        built = kernels.load().small_gemm_paths() if kernels.load() is not None else []
        assert kernels.small_gemm_path() == (built[0] if built else "library")  # the best built, by itself
    finally:
        kernels.small_gemm_path.cache_clear()


@pytest.mark.parametrize("path", [None, "onednn", "avx512_bf16"], ids=["no-bf16-units", "onednn", "bf16-pairs"])
def test_cpu_linear_bfloat16(path, monkeypatch, force_gemm):
    # Without bf16 matmul units the GEMM runs in float32 on widened weights: exactly a bf16 GEMM with float32
    # accumulation, rounded once. With them the weights stay bf16, for oneDNN's GEMM or the native bf16 pairs.
    units = path is not None
    if path == "avx512_bf16" and not kernels.gemm_path_runs(path):
        pytest.skip("this CPU has no AVX512-BF16")
    if units:
        force_gemm(path)
    monkeypatch.setattr(kernels, "has_matmul_units", lambda dtype: units)
    torch.manual_seed(4)
    linear = torch.nn.Linear(64, 96, bias=True, dtype=torch.bfloat16)
    cpu = CpuLinear.from_linear(linear)
    assert cpu.gemm_dtype == (torch.bfloat16 if units else torch.float32)
    assert cpu.bf16_pairs == (path == "avx512_bf16")
    assert (cpu.weight_t is None) == (cpu.packed_only or cpu.bf16_pairs)  # x @ W's copy only where x @ W can run
    for m in (1, 2, 3, 5, 64, 600):
        x = torch.randn(m, 64).to(torch.bfloat16)
        out = cpu(x)
        if path == "onednn" and m < CpuLinear.PACKED_MIN_M:  # padded with zero rows: each row as in a 4-row GEMM
            four = torch.cat([x, torch.randn(CpuLinear.PACKED_MIN_M - m, 64).to(torch.bfloat16)])
            assert out.shape == (m, 96) and torch.equal(out, cpu(four)[:m])
        if path == "avx512_bf16" and m < CpuLinear.PAIR_MAX_M:  # one order per row: a row alone is the same bits
            assert torch.equal(out[:1], cpu(x[:1]))
        assert out.dtype == torch.bfloat16
        exact = (x.float() @ linear.weight.float().t() + linear.bias.float()).to(torch.bfloat16)
        torch.testing.assert_close(out, exact, rtol=1.6e-2, atol=1e-2)


def test_matmul_units_read_from_cpu_flags(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: "flags\t\t: fpu avx512f avx512_vnni")
    assert not kernels.has_matmul_units(torch.bfloat16)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: "flags\t\t: fpu avx512f avx512_bf16 amx_tile")
    assert kernels.has_matmul_units(torch.bfloat16) and not kernels.has_matmul_units(torch.float16)
    assert not kernels.has_matmul_units(torch.float32)


# ---- bfloat16: each kernel computes in float32 and rounds once, so it is at least as close to the float32 result
# as torch's bfloat16 ops (which round after each op) are.
def _no_worse_than_torch_bf16(native_out, torch_bf16_out, float32_out):
    native_err = (native_out.float() - float32_out).abs().mean()
    torch_err = (torch_bf16_out.float() - float32_out).abs().mean()
    assert native_out.dtype == torch.bfloat16 and native_err <= torch_err * 1.05 + 1e-6, (native_err, torch_err)


@pytest.mark.parametrize("rows", [1, 64, 300])
def test_bf16_rms_norm(rows, native_kernels):
    torch.manual_seed(rows)
    x, residual, weight = torch.randn(rows, 576) * 3, torch.randn(rows, 576), torch.rand(576) + 0.5
    xb, rb, wb = x.bfloat16(), residual.bfloat16(), weight.bfloat16()
    norm = RMSNorm(576, 1e-5, torch.bfloat16)
    norm.weight.data.copy_(wb)
    out = native_kernels.rms_norm(xb, rb, wb, 1e-5)
    expected_sum = (xb.float() + residual.bfloat16().float()).bfloat16()
    assert torch.equal(rb, expected_sum)  # the residual stream: one bf16 rounding of the sum, as torch's add
    reference = F.rms_norm(expected_sum.float(), (576,), wb.float(), 1e-5)
    _no_worse_than_torch_bf16(out, norm._norm(expected_sum), reference)


def test_bf16_silu_and_mul(native_kernels):
    torch.manual_seed(0)
    gate_up = (torch.randn(64, 2 * 1536) * 6).bfloat16()
    gate_up[0, :4] = torch.tensor([-200.0, 200.0, float("nan"), -90.0])
    g, u = gate_up.float().chunk(2, dim=-1)
    out = native_kernels.silu_and_mul(gate_up)
    assert torch.isnan(out[0, 2]) and not torch.isnan(out[0, 3])
    finite = torch.ones_like(out, dtype=torch.bool)
    finite[0, 2] = False
    bf16_torch = F.silu(gate_up[:, :1536]) * gate_up[:, 1536:]
    _no_worse_than_torch_bf16(out[finite], bf16_torch[finite], (F.silu(g) * u)[finite])


def test_bf16_rope_and_write_kv(native_kernels):
    torch.manual_seed(1)
    tokens, heads, dim = 37, 12, 64
    x = torch.randn(tokens, heads, dim).bfloat16()
    angles = torch.rand(tokens, dim // 2) * 100
    cos, sin = angles.cos().bfloat16(), angles.sin().bfloat16()
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos.float()[:, None], sin.float()[:, None]
    reference = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    torch_bf16 = torch.cat(
        (x.chunk(2, -1)[0] * cos[:, None] - x.chunk(2, -1)[1] * sin[:, None],
         x.chunk(2, -1)[1] * cos[:, None] + x.chunk(2, -1)[0] * sin[:, None]), dim=-1,
    )  # fmt: skip
    rotated = x.clone()
    native_kernels.rope_(rotated, cos, sin)
    _no_worse_than_torch_bf16(rotated, torch_bf16, reference)
    key, value = torch.randn(5, 3, dim).bfloat16(), torch.randn(5, 3, dim).bfloat16()
    caches = [torch.zeros(4, 2, 3, dim, dtype=torch.bfloat16) for _ in range(2)]
    slots = torch.tensor([7, 0, 3, 5, 1])
    native_kernels.write_kv_(key, value, caches[0], caches[1], slots)
    assert torch.equal(caches[0].view(-1, 3, dim)[slots], key) and torch.equal(caches[1].view(-1, 3, dim)[slots], value)
    with pytest.raises(RuntimeError, match="all float32 or all bfloat16"):
        native_kernels.write_kv_(key.float(), value.float(), caches[0], caches[1], slots)


def test_bf16_linear_on_bf16_units_is_one_packed_gemm(monkeypatch, force_gemm):
    # forced on any CPU: oneDNN's packed bf16 GEMM (emulated where the CPU lacks the units)
    force_gemm("onednn")
    monkeypatch.setattr(kernels, "has_matmul_units", lambda dtype: True)
    torch.manual_seed(2)
    weight, bias = (torch.randn(960, 576) * 0.05).bfloat16(), torch.randn(960).bfloat16()
    linear = CpuLinear(weight, bias)
    if not linear.packed_only:
        pytest.skip("this torch build has no oneDNN bf16 linear")
    assert linear.gemm_dtype == torch.bfloat16
    for m in (1, 16, 64, 600):
        x = torch.randn(m, 576).bfloat16()
        out = linear(x)
        reference = F.linear(x.float(), weight.float(), bias.float())
        assert out.dtype == torch.bfloat16
        torch.testing.assert_close(out.float(), reference, rtol=2e-2, atol=2e-2)


def test_a_kernel_lets_other_python_threads_run_while_it_computes(native_kernels):
    """The native kernels release the interpreter lock: while one runs a long decode attention, this thread keeps
    running Python. Holding the lock, they would stall it for a whole call (the engine loop's kernels then stall the
    threads that stream HTTP or Ray messages in the same process, and those stall the engine in turn)."""
    import threading
    import time

    context, block_size, kv_heads, head_dim, pool_blocks = 8192, 16, 3, 64, 256
    key_cache = torch.randn(pool_blocks, block_size, kv_heads, head_dim)
    value_cache = torch.randn_like(key_cache)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the kernel on one core, this thread on another

    def call(num_seqs: int) -> float:
        # long contexts over a small pool (its blocks shared): ~1.5 ms a sequence on one core
        query = torch.randn(num_seqs, 3 * kv_heads, head_dim)
        tables = (torch.arange(num_seqs * context // block_size) % pool_blocks).view(num_seqs, -1)
        seq_lens = torch.full((num_seqs,), context, dtype=torch.int64)
        started = time.perf_counter()
        native_kernels.paged_decode_attention(
            query, key_cache, value_cache, tables, seq_lens, 0.125, native_kernels.AttentionPath.portable
        )
        return time.perf_counter() - started

    try:
        num_seqs = 64
        while (call_s := call(num_seqs)) < 0.1 and num_seqs < 4096:  # long enough to tell, on any CPU
            num_seqs *= 2
        worker = threading.Thread(target=lambda: [call(num_seqs) for _ in range(3)])
        worker.start()
        longest_gap, last = 0.0, time.perf_counter()
        while worker.is_alive():
            now = time.perf_counter()
            longest_gap, last = max(longest_gap, now - last), now
        worker.join()
    finally:
        torch.set_num_threads(threads)
    assert call_s > 0.05, f"the call ({call_s * 1e3:.0f} ms) is too short to tell"
    assert longest_gap < call_s / 2, (
        f"this thread stalled {longest_gap * 1e3:.0f} ms; one call takes {call_s * 1e3:.0f}"
    )
