"""`--dtype half` / float16: accepted in every spelling and run, on fp16 matmul units where the CPU has them,
else by float32 GEMMs on widened weights; greedy tokens of a tiny Llama equal float32's."""

from __future__ import annotations

import pytest

from batchserve import LLM, SamplingParams
from tests.tiny_models import build_hf_model, save_word_tokenizer


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny_llama_fp16")
    build_hf_model("llama", directory)
    save_word_tokenizer(directory)
    return directory


def test_half_runs_and_matches_float32_greedy(tiny_dir):
    prompts = [{"prompt_token_ids": [5, 17, 33, 8, 61]}, {"prompt_token_ids": [40, 41, 3]}]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outputs = {}
    for dtype in ("half", "float32"):
        llm = LLM(model=str(tiny_dir), dtype=dtype, device="cpu", num_kv_blocks=16, max_batch_size=4)
        outputs[dtype] = [out.token_ids for out in llm.generate(prompts, params)]
        if dtype == "half":
            assert llm.engine.config.dtype == "float16"
    assert outputs["half"] == outputs["float32"] and all(len(ids) == 6 for ids in outputs["half"])
