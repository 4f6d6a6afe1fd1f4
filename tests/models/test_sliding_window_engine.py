"""The engine end to end on a model whose every layer is windowed (tiny Mistral, W=8): blocks that left the window go
back to the pool while requests run, and greedy float32 tokens stay those of transformers."""

from __future__ import annotations

from batchserve.entrypoints.llm import LLM
from batchserve.sampling_params import SamplingParams
from tests.models.test_hf_folder import save_tokenizer
from tests.models.test_llama import prompt_ids
from tests.tiny_models import build_hf_model, hf_greedy

BLOCK_SIZE = 16
WINDOW = 8


def test_a_windowed_model_releases_blocks_and_keeps_transformers_tokens(tmp_path):
    hf, directory = build_hf_model("mistral_window", tmp_path), tmp_path
    save_tokenizer(directory)
    llm = LLM(model=str(directory), device="cpu", dtype="float32", block_size=BLOCK_SIZE, num_kv_blocks=32,
              max_num_tokens=24)  # fmt: skip
    engine = llm.engine
    kv = engine.scheduler.kv
    assert kv.sliding_window == WINDOW and kv.null_block is not None
    most_held: dict[str, int] = {}
    step = engine.step

    def step_and_count():
        out = step()
        for request in engine.scheduler.running:
            rid = request.request_id
            most_held[rid] = max(most_held.get(rid, 0), kv.num_blocks_of(request))
        return out

    engine.step = step_and_count
    prompts = [prompt_ids(11, 70), prompt_ids(12, 9)]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        assert list(out.token_ids) == hf_greedy(hf, prompt, 12)
    # 82 tokens would take 6 blocks; a 24-token step over an 8-token window holds at most cdiv(8 + 24, 16) + 1
    assert max(most_held.values()) <= kv.max_live_blocks(82, 24) == 3
    assert kv.pool.num_free_blocks == kv.pool.num_blocks - 1  # all back but the null block
