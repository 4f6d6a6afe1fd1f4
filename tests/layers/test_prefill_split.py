"""Prefill attention by chunk length ("split", BATCHSERVE_PREFILL_ATTENTION=split): chunks of at most
paths.SHORT_PREFILL_MAX_ROWS rows take the native prefill kernel, batched, longer ones one SDPA each. The choice is the
chunk's own, so each row of a mixed step is the same, bit for bit, as its prompt attended alone, on every attention
path, in the native step (kernels/step_attention.cpp) and in the Python code (layers/attention.py) alike."""

from __future__ import annotations

import pytest
import torch

from batchserve.layers import attention, kernels
from batchserve.layers.attention import preferred_prefill_method
from batchserve.layers.kernels import paths
from tests.layers.test_attention import BF16_TOLERANCE, F32_TOLERANCE, run_batch

HEADS = (9, 3, 64)
# (cached tokens, tokens this step): with the threshold at 16, short chunks (5, 16 fresh and after 16 cached, 2, 3
# after 100) and long ones (37 fresh, 20 after 13, 33 after 7), next to a decode
SEQS = [(0, 5), (0, 37), (13, 20), (40, 1), (7, 33), (0, 16), (16, 16), (0, 2), (100, 3)]
THRESHOLD = 16


@pytest.fixture
def force(monkeypatch, native_kernels):
    """force(path, method, threshold): attention path, prefill method and the split's threshold for the next calls
    (skipped where the path cannot run here)."""

    def apply(path: str, method: str = "split", threshold: int = THRESHOLD) -> None:
        if not kernels.attention_path_runs(path):
            pytest.skip(f"attention path {path!r} cannot run on this CPU")
        monkeypatch.setenv("BATCHSERVE_ATTENTION_PATH", path)
        monkeypatch.setenv("BATCHSERVE_PREFILL_ATTENTION", method)
        monkeypatch.setattr(paths, "SHORT_PREFILL_MAX_ROWS", threshold)
        kernels.attention_path.cache_clear()
        preferred_prefill_method.cache_clear()

    yield apply
    kernels.attention_path.cache_clear()
    preferred_prefill_method.cache_clear()


def sequence_tensors(seqs, dtype, seed=0):
    """Each sequence's q, k, v over its whole length, fixed, so that a prompt alone and in a batch sees the same."""
    gen = torch.Generator().manual_seed(seed)
    heads, kv_heads, head_dim = HEADS
    return [
        tuple(torch.randn(c + n, h, head_dim, generator=gen).to(dtype) for h in (heads, kv_heads, kv_heads))
        for c, n in seqs
    ]


def rows_by_sequence(out, batch, seqs):
    """The step's output rows of each sequence (the batch packs them in its own order, decodes first)."""
    rows, start = {}, 0
    for rid in batch.req_ids:
        i = int(rid[1:])
        rows[i] = out[start : start + seqs[i][1]]
        start += seqs[i][1]
    return rows


def mixed_and_alone(seqs, block_size, dtype):
    tensors = sequence_tensors(seqs, dtype)
    out, expected, batch = run_batch(seqs, block_size, stale=True, heads=HEADS, dtype=dtype, tensors=tensors)
    tolerance = BF16_TOLERANCE if dtype == torch.bfloat16 else F32_TOLERANCE
    torch.testing.assert_close(out.float(), expected, **tolerance)
    mixed = rows_by_sequence(out, batch, seqs)
    alone = {
        i: run_batch([seqs[i]], block_size, stale=True, heads=HEADS, dtype=dtype, tensors=[tensors[i]])[0]
        for i in range(len(seqs))
        if seqs[i][1] > 1
    }
    return mixed, alone


@pytest.mark.parametrize("path", kernels.ATTENTION_PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
@pytest.mark.parametrize("block_size", [9, 16])
@pytest.mark.parametrize("code", ["native-step", "python"])
def test_mixed_step_rows_equal_each_prompt_alone(path, dtype, block_size, code, force, monkeypatch):
    # Short and long chunks in one step: each prompt's rows are those of the prompt attended alone, bit for bit (on
    # "avx2" and "portable", which have no prefill kernel, every chunk takes SDPA). "python": the torch-side code of
    # layers/attention.py, which the CPU runs where the native step does not take a step.
    force(path)
    if code == "python":
        monkeypatch.setattr(attention, "native_step", lambda *_: None)
    mixed, alone = mixed_and_alone(SEQS, block_size, dtype)
    for i, rows in alone.items():
        assert torch.equal(mixed[i], rows), f"sequence {SEQS[i]}: its rows changed with the step's other prompts"


@pytest.mark.parametrize("path", ["avx512_bf16", "avx512"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_each_chunk_takes_the_path_of_its_own_length(path, dtype, force, monkeypatch):
    # The rows of chunks of at most the threshold are the native kernel's, bit for bit, the others SDPA's; moving the
    # threshold moves them; and the Python code splits exactly as the native step does.
    tensors = sequence_tensors(SEQS, dtype)

    def step(method, threshold=THRESHOLD, python=False):
        force(path, method, threshold)
        with monkeypatch.context() as patch:
            if python:
                patch.setattr(attention, "native_step", lambda *_: None)
            out, _, batch = run_batch(SEQS, 16, stale=True, heads=HEADS, dtype=dtype, tensors=tensors)
        return out, rows_by_sequence(out, batch, SEQS)

    native, sdpa = step("native")[1], step("sdpa")[1]
    split_out, split = step("split")
    assert torch.equal(split_out, step("split", python=True)[0])
    for i, (_, n) in enumerate(SEQS):
        if n > 1:
            assert torch.equal(split[i], native[i] if n <= THRESHOLD else sdpa[i]), f"sequence {SEQS[i]}"
    differs = [i for i, (_, n) in enumerate(SEQS) if n > 1 and not torch.equal(native[i], sdpa[i])]
    assert differs, "the two paths gave the same bits: the test cannot tell which ran"
    assert all(torch.equal(step("split", 0)[1][i], sdpa[i]) for i in differs)
    assert all(torch.equal(step("split", 37)[1][i], native[i]) for i in differs)


def test_split_threshold_is_logged_once(monkeypatch, caplog, force):
    # Asked for (on a CPU with AMX, for a bfloat16 pool), its threshold named in the one start-up line.
    monkeypatch.setenv("BATCHSERVE_PREFILL_ATTENTION", "split")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: "flags : fpu avx512f avx512_bf16 amx_tile amx_bf16")
    monkeypatch.setattr(paths, "SHORT_PREFILL_MAX_ROWS", 96)
    preferred_prefill_method.cache_clear()
    with caplog.at_level("INFO", logger=attention.__name__):
        assert preferred_prefill_method(torch.bfloat16) == preferred_prefill_method(torch.bfloat16) == "split"
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("prefill attention on")]
    assert len(lines) == 1 and "<= 96 rows native" in lines[0]
    assert attention.native_prefill_rows("split") == 96
    assert attention.native_prefill_rows("sdpa") == 0
    assert attention.native_prefill_rows("native") >= 2**31


def test_prefill_path_choice(monkeypatch, force_prefill):
    # For bfloat16 pools where the CPU has AMX, the native kernel where it runs on the tiles, else SDPA (on its
    # tiles); the native kernel elsewhere and for float32 pools; the engine's prefill_attention option picks another,
    # the variable forces any of them over it, and an unknown name is an error.
    monkeypatch.delenv("BATCHSERVE_PREFILL_ATTENTION", raising=False)
    amx = "avx512f avx512_bf16 amx_tile amx_bf16"
    cases = [(amx, "avx512", "sdpa"), ("avx512f avx512_bf16", "avx512", "native")]
    if kernels.prefill_kernel_path_runs("amx_emulated"):  # an AVX-512 build: the AMX kernel, emulated, forced
        cases.append((amx, "amx_emulated", "native"))
    for flags, kernel, bf16_path in cases:
        monkeypatch.setattr(kernels, "cpu_flags", lambda flags=flags: f"flags : fpu {flags}")
        if kernels.prefill_kernel_path_runs(kernel):  # else (no AVX-512 build) no prefill kernel: the same answer
            monkeypatch.setenv("BATCHSERVE_PREFILL_KERNEL_PATH", kernel)
        kernels.prefill_kernel_path.cache_clear()
        preferred_prefill_method.cache_clear()
        assert (
            preferred_prefill_method(torch.bfloat16) == bf16_path
            and preferred_prefill_method(torch.float32) == "native"
        )
        assert preferred_prefill_method(torch.bfloat16, "split") == "split"
    with pytest.raises(ValueError, match="prefill_attention='fastest'"):
        preferred_prefill_method(torch.float32, "fastest")
    monkeypatch.delenv("BATCHSERVE_PREFILL_KERNEL_PATH", raising=False)
    kernels.prefill_kernel_path.cache_clear()
    force_prefill("sdpa")
    assert preferred_prefill_method(torch.float32) == "sdpa"
    assert preferred_prefill_method(torch.bfloat16, "split") == "sdpa"  # the variable over the option
    force_prefill("fastest")
    with pytest.raises(ValueError, match="BATCHSERVE_PREFILL_ATTENTION"):
        preferred_prefill_method(torch.bfloat16)
