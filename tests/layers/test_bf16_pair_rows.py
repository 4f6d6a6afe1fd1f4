"""The bf16 pair kernel in the row schedule (layers/linear.py CpuLinear.PAIR_MAX_M, kernels/projection.cpp): on a CPU
with AVX512-BF16 and no AMX a bf16 projection takes the pairs below the threshold and oneDNN's GEMM from it; where the
model keeps one copy (LinearPolicy.one_bf16_copy, keeps_one_bf16_copy: too large for two, or speculating) or no call
carries that many rows, the pairs take every M and no oneDNN copy is made."""

from __future__ import annotations

import pytest
import torch

from batchserve.host.memory import GiB
from batchserve.layers import kernels
from batchserve.layers.linear import (
    DEFAULT_POLICY,
    CpuLinear,
    LinearPolicy,
    engine_layouts,
    keeps_one_bf16_copy,
    loading_policy,
)

NO_AMX = "flags\t\t: fpu avx2 fma avx512f avx512_bf16"  # the EPYC of family 25: vdpbf16ps, no AMX tiles


@pytest.fixture
def no_amx_host(native_kernels, force_gemm, monkeypatch):
    """The kernel table's own choice (nothing forced) on a CPU that counts as having AVX512-BF16 and no AMX."""
    if not kernels.gemm_path_runs("avx512_bf16"):
        pytest.skip("this CPU or build cannot run the bf16 pair kernel (avx512_bf16)")
    force_gemm("auto")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: NO_AMX)
    assert kernels.bf16_gemm_path() == "avx512_bf16"
    return native_kernels


SPLIT = 24  # where the pairs stopped winning on the EPYC of family 25 (docs/cpu-kernels.md)


@pytest.fixture
def split_by_rows(no_amx_host):
    """The pair kernel below SPLIT rows, oneDNN from there: this host class's default."""
    assert CpuLinear.PAIR_MAX_M == SPLIT
    return no_amx_host


def _layer(policy: LinearPolicy = DEFAULT_POLICY) -> tuple[CpuLinear, torch.Tensor]:
    torch.manual_seed(11)
    bias = torch.randn(96).bfloat16()
    return CpuLinear((torch.randn(96, 64) * 0.1).bfloat16(), bias, policy=policy), bias


def _pairs(native, linear: CpuLinear, x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """What the pair kernel gives for x: its float32 sum plus the bias, rounded once to bf16."""
    return (native.bf16_gemm(x, linear.bf16_packed, linear.out_features) + bias).bfloat16()


def test_decode_rows_take_the_pairs_and_longer_rows_onednn(split_by_rows):
    no_amx_host = split_by_rows
    linear, bias = _layer()
    if linear.packed is None:
        pytest.skip("this torch build has no oneDNN bf16 linear")
    limit = CpuLinear.PAIR_MAX_M
    assert linear.bf16_pairs and linear.bf16_packed is not None and linear.rows.pair_max_m == limit
    assert linear.weight_t is None and linear.amx_packed is None  # two layouts, not three
    for m in (1, 8, limit - 1, limit, 40):  # under 64 rows oneDNN is called with m rows as they are
        x = torch.randn(m, 64).bfloat16()
        onednn = torch.ops.mkldnn._linear_pointwise(x, linear.packed, bias, "none", [], "")
        expected = _pairs(no_amx_host, linear, x, bias) if m < limit else onednn
        assert torch.equal(linear(x), expected), m


@pytest.mark.parametrize(
    "policy",
    [LinearPolicy(one_bf16_copy=True), LinearPolicy(max_rows=SPLIT - 1)],
    ids=["one-copy", "no-longer-rows"],
)
def test_one_copy_runs_the_pairs_at_every_m(split_by_rows, policy):
    no_amx_host = split_by_rows
    linear, bias = _layer(policy)
    assert linear.bf16_pairs and linear.packed is None and linear.weight_t is None
    for m in (1, SPLIT, 40):  # a longer call than max_rows (none should come) still computes
        x = torch.randn(m, 64).bfloat16()
        assert torch.equal(linear(x), _pairs(no_amx_host, linear, x, bias)), m
    assert _layer(LinearPolicy(max_rows=SPLIT))[0].packed is not None  # those rows reach oneDNN


def test_a_model_keeps_one_copy_only_where_two_would_not_fit(split_by_rows, force_gemm, monkeypatch):
    assert not keeps_one_bf16_copy(GiB // 4, 20 * GiB, torch.bfloat16)  # the default model: two copies
    assert keeps_one_bf16_copy(16 * GiB, 22 * GiB, torch.bfloat16)  # Llama-3.1-8B on a 24 GiB host: the pairs alone
    assert not keeps_one_bf16_copy(16 * GiB, 22 * GiB, torch.float32)  # float32 never takes the pairs
    assert keeps_one_bf16_copy(GiB // 4, 20 * GiB, torch.bfloat16, speculating=True)  # verify steps round as decodes
    force_gemm("onednn")
    assert not keeps_one_bf16_copy(16 * GiB, 22 * GiB, torch.bfloat16)  # oneDNN alone: one copy anyway
    force_gemm("auto")
    monkeypatch.setattr(kernels, "cpu_flags", lambda: NO_AMX)
    monkeypatch.setattr(CpuLinear, "PAIR_MAX_M", 2**62)
    assert not keeps_one_bf16_copy(16 * GiB, 22 * GiB, torch.bfloat16)  # the pairs at every M: one copy anyway


def test_an_engines_layouts_carry_every_choice_at_once():
    """engine_layouts: deterministic mode, the row bound and the one-copy rule together, none undoing another."""
    with engine_layouts(True, 19, True):
        policy = loading_policy()
        assert policy.deterministic and policy.max_rows == 19 and policy.one_bf16_copy
    assert loading_policy() == DEFAULT_POLICY
