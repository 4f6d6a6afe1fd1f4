"""The engine hands its max_num_tokens to the projections it lays out (LinearPolicy.max_rows): bf16 on AMX keeps
oneDNN's packed copy only where a step can carry the rows that take it, so a model whose steps never do holds each
projection's weight once, and computes what the two-copy layout computes for those steps."""

from __future__ import annotations

import pytest

from batchserve.entrypoints.llm import LLM
from batchserve.layers import kernels
from batchserve.layers.linear import CpuLinear
from batchserve.sampling_params import SamplingParams
from tests.forcing import force_gemm  # noqa: F401  (a fixture of the test here)
from tests.tiny_models import build_hf_model, save_word_tokenizer

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="native kernels not built here")
PROMPT = [5, 9, 14, 3, 22, 8]


def _projections(llm: LLM) -> list[CpuLinear]:
    model = llm.engine.runner.model
    return [module for module in model.layers.modules() if isinstance(module, CpuLinear)]


def test_steps_under_the_amx_row_limit_keep_one_layout_of_each_projection(tmp_path, force_gemm):  # noqa: F811
    force_gemm("amx_emulated")
    build_hf_model("llama_head64", tmp_path)
    save_word_tokenizer(tmp_path)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    tokens = {}
    for max_num_tokens in (CpuLinear.AMX_MAX_M - 1, CpuLinear.AMX_MAX_M):
        llm = LLM(model=str(tmp_path), dtype="bfloat16", num_kv_blocks=32, max_num_tokens=max_num_tokens)
        projections = _projections(llm)
        assert projections and all(p.amx_packed is not None for p in projections)
        assert all((p.packed is None) == (max_num_tokens < CpuLinear.AMX_MAX_M) for p in projections)
        tokens[max_num_tokens] = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].token_ids
    assert tokens[CpuLinear.AMX_MAX_M - 1] == tokens[CpuLinear.AMX_MAX_M]


def test_a_packed_layout_is_kept_as_made_unless_it_shares_the_weights_memory(monkeypatch):
    """Without huge pages a packer's fresh output is the layout itself (no clone); one that is the weight's own
    memory (a packing that changed nothing) is still copied, so the layout never aliases the weight."""
    import torch

    from batchserve.layers import linear

    monkeypatch.setenv("BATCHSERVE_HUGE_PAGES", "0")
    weight = torch.randn(64, 32)
    fresh = weight.t().contiguous()
    assert linear._packed_streamed(fresh, weight) is fresh
    aliasing = linear._packed_streamed(weight.view(64, 32), weight)
    assert torch.equal(aliasing, weight)
    assert aliasing.untyped_storage().data_ptr() != weight.untyped_storage().data_ptr()
