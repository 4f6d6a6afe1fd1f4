"""Sliding-window and soft-capped attention on the paged KV cache (layers/windowed_attention.py) against a dense
reference with transformers' mask (key j visible to the query at p iff p - W < j <= p), in decode rows, fresh prompts
and chunks after earlier context in one mixed step; blocks that left the window are never read."""

from __future__ import annotations

import pytest
import torch
import transformers

from batchserve.core.outputs import NewRequestData, SchedulerOutput
from batchserve.layers import kernels
from batchserve.layers.attention import paged_attention
from batchserve.layers.capabilities import Capability
from batchserve.sampling_params import SamplingParams
from batchserve.worker.input_batch import RequestTable
from tests.models.conftest import MiniScheduler, make_runner
from tests.models.test_llama import prompt_ids
from tests.tiny_models import hf_greedy

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 4, 2, 8
# (context before this step, tokens this step): decodes first, then a fresh prompt and chunks after context
SEQS = [(30, 1), (6, 1), (3, 1), (0, 13), (21, 7), (5, 40)]


def mixed_step(block_size: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-(c + n) // block_size) for c, n in SEQS) + 1
    shape = (num_blocks, block_size, NUM_KV_HEADS, HEAD_DIM)
    kv = (torch.randn(shape, generator=g), torch.randn(shape, generator=g))
    free = torch.randperm(num_blocks, generator=g).tolist()
    new, tables = [], []
    for i, (context, n) in enumerate(SEQS):
        need = -(-(context + n) // block_size)
        blocks, free = free[:need], free[need:]
        tables.append(blocks)
        new.append(NewRequestData(f"r{i}", [5] * (context + n), context + n, SamplingParams(temperature=0.0),
                                  blocks, context))  # fmt: skip
    out = SchedulerOutput(new_requests=new, num_scheduled_tokens={r.req_id: n for r, (_, n) in zip(new, SEQS)})
    table = RequestTable(block_size)
    table.apply(out)
    batch = table.build(out, torch.device("cpu"))
    num_tokens = batch.input_ids.shape[0]
    q = torch.randn(num_tokens, NUM_HEADS, HEAD_DIM, generator=g)
    k = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=g)
    v = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=g)
    return batch, kv, tables, (q, k, v)


def dense_reference(q, kv, tables, block_size, scale, window, softcap):
    """Each sequence's queries over its whole context, read position by position, under the explicit mask."""
    outs, row = [], 0
    for (context, n), blocks in zip(SEQS, tables, strict=True):
        total = context + n
        slots = torch.tensor([blocks[p // block_size] * block_size + p % block_size for p in range(total)])
        # poisoned (out-of-window) positions read as 0 here: the mask hides them
        keys, values = (
            c.view(-1, NUM_KV_HEADS, HEAD_DIM)[slots].repeat_interleave(2, dim=1).nan_to_num(0.0) for c in kv
        )
        scores = torch.einsum("qhd,khd->hqk", q[row : row + n], keys) * scale
        if softcap is not None:
            scores = softcap * torch.tanh(scores / softcap)
        qpos, kpos = torch.arange(context, total)[:, None], torch.arange(total)[None, :]
        visible = (kpos <= qpos) & ((kpos > qpos - window) if window else True)
        probs = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        outs.append(torch.einsum("hqk,khd->qhd", probs, values))
        row += n
    return torch.cat(outs)


def poison_blocks_out_of_window(kv, tables, block_size, window) -> None:
    """NaN in every block no query of this step can see: reading one would spread NaN through the output."""
    for (context, _), blocks in zip(SEQS, tables, strict=True):
        first_visible = max(0, context - window + 1)
        for block in blocks[: first_visible // block_size]:
            kv[0][block].fill_(float("nan"))
            kv[1][block].fill_(float("nan"))


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("window,softcap", [(8, None), (5, None), (8, 2.0), (None, 2.0), (1, None)])
def test_windowed_attention_matches_the_dense_reference(block_size, window, softcap):
    batch, kv, tables, (q, k, v) = mixed_step(block_size, seed=block_size + (window or 0))
    meta = batch.attn_metadata
    assert meta.decode is not None and meta.prefill is not None  # a mixed step: both groups ran
    if window is not None:
        poison_blocks_out_of_window(kv, tables, block_size, window)
    scale = 0.3
    out = paged_attention(q, k, v, kv, meta, scale=scale, window=window, softcap=softcap)
    ref = dense_reference(q, kv, tables, block_size, scale, window, softcap)
    assert not out.isnan().any()
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_a_window_wider_than_the_context_is_full_causal_attention():
    batch, kv, _, (q, k, v) = mixed_step(4, seed=3)
    full = paged_attention(q, k, v, (kv[0].clone(), kv[1].clone()), batch.attn_metadata, scale=0.3)
    wide = paged_attention(q, k, v, kv, batch.attn_metadata, scale=0.3, window=1000)
    torch.testing.assert_close(wide, full, atol=1e-5, rtol=1e-5)


def test_long_prefill_tiles_queries(monkeypatch):
    """Query tiles smaller than the chunks: each tile reads only the keys its window reaches, same result."""
    from batchserve.layers import windowed_attention

    batch, kv, tables, (q, k, v) = mixed_step(4, seed=5)
    monkeypatch.setattr(windowed_attention, "QUERY_TILE", 3)
    out = paged_attention(q, k, v, kv, batch.attn_metadata, scale=0.3, window=6, softcap=2.0)
    ref = dense_reference(q, kv, tables, 4, 0.3, 6, 2.0)  # after the call: it wrote this step's K/V to the pool
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


PROMPTS = {"a": prompt_ids(2, 37), "b": prompt_ids(3, 4), "c": prompt_ids(4, 20)}
MAX_NEW = {"a": 10, "b": 16, "c": 5}


def _staggered_equals_transformers(hf, runner) -> dict[str, list[int]]:
    """Prompts of 37 and 20 tokens in chunks of 5 beside another request's decodes: transformers' greedy tokens."""
    sched = MiniScheduler(runner, chunk=5)
    sched.add("b", PROMPTS["b"], MAX_NEW["b"])
    outputs = sched.run(hooks={2: lambda s: s.add("a", PROMPTS["a"], MAX_NEW["a"]),
                               3: lambda s: s.add("c", PROMPTS["c"], MAX_NEW["c"])})  # fmt: skip
    assert outputs == {name: hf_greedy(hf, prompt, MAX_NEW[name]) for name, prompt in PROMPTS.items()}
    return outputs


def _unwindowed_greedy(hf, config, name: str) -> list[int]:
    """transformers' greedy tokens for the same weights under `config` (the model without its window)."""
    full = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    full.load_state_dict(hf.state_dict())
    full.generation_config.eos_token_id = None
    return hf_greedy(full, PROMPTS[name], MAX_NEW[name])


def test_mistral_honours_its_window(tiny_models):
    """Mistral with sliding_window=8, block size 4 (the native decoder loop where the kernels are built):
    transformers' tokens (it masks by the window), and not those of the same weights without the window."""
    hf, directory = tiny_models("mistral_window")
    runner = make_runner(directory, block_size=4, num_kv_blocks=64)
    assert runner.model_config.sliding_window == 8
    assert (runner.model.decoder_loop is not None) == (kernels.load() is not None)
    assert Capability.SLIDING_WINDOW in runner.model.capabilities
    outputs = _staggered_equals_transformers(hf, runner)
    full = transformers.MistralConfig(**{**hf.config.to_dict(), "sliding_window": None})
    assert outputs["a"] != _unwindowed_greedy(hf, full, "a"), "the window must change these tokens"


def test_qwen_use_sliding_window_windows_the_layers_transformers_windows(tiny_models):
    """Qwen2 with use_sliding_window, window 8 from layer 1 of 2 (max_window_layers 1): only that layer is windowed,
    the pool keeps every block (a global layer still reads them); greedy float32 tokens equal transformers'."""
    hf, directory = tiny_models("qwen2_window")
    runner = make_runner(directory, block_size=4, num_kv_blocks=64)
    config = runner.model_config
    assert config.sliding_window is None and config.extra == {"windowed_layers": [1], "layer_window": 8}
    assert [layer.self_attn.window for layer in runner.model.layers] == [None, 8]
    assert Capability.SLIDING_WINDOW in runner.model.capabilities
    assert (runner.model.decoder_loop is not None) == (kernels.load() is not None)
    outputs = _staggered_equals_transformers(hf, runner)
    full = transformers.Qwen2Config(**{**hf.config.to_dict(), "use_sliding_window": False, "layer_types": None})
    assert outputs["a"] != _unwindowed_greedy(hf, full, "a"), "the window must change these tokens"
