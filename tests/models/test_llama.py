"""Our Llama-family model against transformers: config parsing, logits, and greedy generation through ModelRunner."""

from __future__ import annotations

import pytest
import torch

from batchserve.core.outputs import NewRequestData, SchedulerOutput
from batchserve.sampling_params import SamplingParams
from batchserve.worker.input_batch import RequestTable
from tests.models.conftest import MiniScheduler, load_ours, make_runner
from tests.tiny_models import KINDS, VOCAB, hf_greedy


def prompt_ids(seed: int, length: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (length,), generator=g).tolist()


def our_prefill_logits(
    model, config, tokens: list[int], block_size: int = 16, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """One sequence, whole prompt in one step, through the real input-batch builder and paged attention."""
    num_blocks = -(-len(tokens) // block_size) + 1
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    kv = [(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)) for _ in range(config.num_layers)]
    blocks = list(range(num_blocks))[::-1]
    out = SchedulerOutput(
        new_requests=[NewRequestData("r", tokens, len(tokens), SamplingParams(temperature=0.0), blocks, 0)],
        num_scheduled_tokens={"r": len(tokens)},
    )
    states = RequestTable(block_size)
    states.apply(out)
    batch = states.build(out, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(batch.input_ids, batch.positions, kv, batch.attn_metadata)
        return model.compute_logits(hidden)


@pytest.mark.parametrize("kind", list(KINDS))
def test_config_read_from_hf_directory(tiny_models, kind):
    hf, directory = tiny_models(kind)
    config, _ = load_ours(directory)
    hf_cfg = hf.config
    assert config.vocab_size == hf_cfg.vocab_size
    assert config.num_layers == hf_cfg.num_hidden_layers
    assert config.num_kv_heads == hf_cfg.num_key_value_heads
    assert config.head_dim == getattr(hf_cfg, "head_dim", None) or hf_cfg.hidden_size // hf_cfg.num_attention_heads
    assert config.tie_word_embeddings == hf_cfg.tie_word_embeddings
    assert config.eos_token_ids == [2]
    assert config.bos_token_id == 1
    assert config.attention_bias == (kind.startswith("qwen2") or kind == "llama_attn_bias_mha")
    if kind == "llama3_rope":
        assert config.rope_scaling["rope_type"] == "llama3" and config.rope_theta == 500000.0
    if kind == "llama_linear_rope":
        assert config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    if kind == "llama":
        assert config.rope_scaling is None


@pytest.mark.parametrize("kind", list(KINDS))
def test_logits_match_transformers(tiny_models, kind):
    hf, directory = tiny_models(kind)
    config, model = load_ours(directory)
    # long enough that llama3 / linear scaling change the result (positions past original_max_position_embeddings)
    tokens = prompt_ids(1, 70)
    ours = our_prefill_logits(model, config, tokens)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    assert ours.shape == ref.shape
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_tied_model_shares_the_embedding(tiny_models):
    _, directory = tiny_models("llama_tied")
    _, model = load_ours(directory)
    assert model.lm_head is None
    assert model.output_weight is model.embed_tokens.weight


def test_eos_list_from_generation_config(tiny_models, tmp_path):
    import json
    import shutil

    _, directory = tiny_models("llama")
    copy = tmp_path / "m"
    shutil.copytree(directory, copy)
    (copy / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 2, 9]}))
    config, _ = load_ours(copy)
    assert config.eos_token_ids == [7, 2, 9]


@pytest.mark.parametrize(
    "kind,block_size,chunk",
    [("llama", 8, 7), ("llama", 16, 5), ("qwen2", 8, 16), ("llama3_rope", 16, 9), ("mistral", 8, 3)],
)
def test_greedy_generation_matches_transformers(tiny_models, kind, block_size, chunk):
    """Chunked prefill in several chunks, mixed with other sequences' decodes, scattered blocks."""
    hf, directory = tiny_models(kind)
    prompts = {"a": prompt_ids(2, 37), "b": prompt_ids(3, 4), "c": prompt_ids(4, 20)}
    max_new = 12
    sched = MiniScheduler(make_runner(directory, block_size=block_size, num_kv_blocks=48), chunk=chunk)
    sched.add("b", prompts["b"], max_new)
    # "a" and "c" arrive later, so their prefill chunks share steps with b's decodes
    outputs = sched.run(
        hooks={2: lambda s: s.add("a", prompts["a"], max_new), 3: lambda s: s.add("c", prompts["c"], 5)}
    )
    assert outputs["a"] == hf_greedy(hf, prompts["a"], max_new)
    assert outputs["b"] == hf_greedy(hf, prompts["b"], max_new)
    assert outputs["c"] == hf_greedy(hf, prompts["c"], 5)
    assert not sched.runner.requests, "finished requests must be forgotten"


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_then_resume_matches_transformers(tiny_models, mode):
    hf, directory = tiny_models("llama")
    prompts = {"a": prompt_ids(5, 21), "b": prompt_ids(6, 11)}
    max_new = 10
    runner = make_runner(directory, block_size=8, num_kv_blocks=32, num_swap_blocks=8 if mode == "swap" else 0)
    sched = MiniScheduler(runner, chunk=6)
    for req_id, prompt in prompts.items():
        sched.add(req_id, prompt, max_new)
    hooks = {6: lambda s: s.preempt("a", mode), 9: lambda s: s.resume("a")}
    outputs = sched.run(hooks=hooks)
    assert outputs["a"] == hf_greedy(hf, prompts["a"], max_new)
    assert outputs["b"] == hf_greedy(hf, prompts["b"], max_new)


def test_prefix_cache_hit_matches_transformers(tiny_models):
    """A new request whose first blocks already hold its prefix K/V (num_computed_tokens > 0 on admission)."""
    hf, directory = tiny_models("llama")
    block_size = 8
    sched = MiniScheduler(make_runner(directory, block_size=block_size, num_kv_blocks=32), chunk=32)
    shared = prompt_ids(7, 19)
    sched.add("a", shared, 1)
    sched.run()
    full_blocks = sched.reqs["a"]["blocks"][: len(shared) // block_size]
    sched.free = [b for b in sched.free if b not in full_blocks]  # the prefix cache keeps them
    prompt = shared[: len(full_blocks) * block_size] + prompt_ids(8, 9)
    sched.add("b", prompt, 8, blocks=full_blocks, computed=len(full_blocks) * block_size)
    outputs = sched.run()
    assert outputs["b"] == hf_greedy(hf, prompt, 8)


def test_no_sampling_for_a_partial_prefill(tiny_models):
    _, directory = tiny_models("llama")
    runner = make_runner(directory, block_size=8, num_kv_blocks=8)
    out = runner.execute(
        SchedulerOutput(
            new_requests=[NewRequestData("r", prompt_ids(9, 12), 12, SamplingParams(temperature=0.0), [3, 1], 0)],
            num_scheduled_tokens={"r": 8},
        )
    )
    assert out.req_ids == [] and out.sampled_token_ids == []
    assert runner.requests.num_computed[runner.requests.row_of["r"]] == 8
