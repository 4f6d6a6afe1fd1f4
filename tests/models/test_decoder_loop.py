"""The native decoder loop of decode steps (kernels/decoder_loop.cpp) against the Python layers it stands in for:
the same operators in the same order, so the hidden states and the K/V it writes must be bit for bit the same,
whatever GEMM path the rows take (one row, the small-M kernel, oneDNN packed, bf16 rows padded to 4)."""

from __future__ import annotations

import pytest
import torch
from tests.models.conftest import load_ours
from tests.tiny_models import VOCAB

from batchserve.core.outputs import NewRequestData, SchedulerOutput
from batchserve.layers import kernels
from batchserve.models.llama import DecoderLayer
from batchserve.sampling_params import SamplingParams
from batchserve.worker.input_batch import RequestTable

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="native kernels not built here")


def decode_step(config, num_seqs: int, block_size: int, dtype: torch.dtype, seed: int):
    """A decode-only batch: each sequence has a context of random K/V in scattered blocks and computes one token."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 60, (num_seqs,), generator=g).tolist()
    num_blocks = sum(-(-n // block_size) for n in lens) + 1
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    kv = [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
          for _ in range(config.num_layers)]  # fmt: skip
    free = torch.randperm(num_blocks, generator=g).tolist()
    new = []
    for i, n in enumerate(lens):
        need = -(-n // block_size)
        blocks, free = free[:need], free[need:]
        tokens = torch.randint(3, VOCAB, (n,), generator=g).tolist()
        new.append(NewRequestData(f"r{i}", tokens, n, SamplingParams(temperature=0.0), blocks, n - 1))
    out = SchedulerOutput(new_requests=new, num_scheduled_tokens={r.req_id: 1 for r in new})
    table = RequestTable(block_size)
    table.apply(out)
    return table.build(out, torch.device("cpu")), kv


def forward(model, batch, kv):
    caches = [(k.clone(), v.clone()) for k, v in kv]
    with torch.inference_mode():
        hidden = model(batch.input_ids, batch.positions, caches, batch.attn_metadata)
    return hidden, caches


@pytest.mark.parametrize("num_seqs", [1, 3, 7, 70])
@pytest.mark.parametrize(
    "kind,dtype,units",
    [
        ("llama", torch.float32, None),
        ("qwen2", torch.float32, None),  # q/k/v biases
        ("llama_attn_bias_mha", torch.float32, None),  # o_proj bias, no GQA, head size 8
        ("llama_tied", torch.bfloat16, "1"),  # oneDNN bf16 GEMMs on packed weights, fewer than 4 rows padded
        ("qwen2", torch.bfloat16, "1"),
        ("llama", torch.bfloat16, "0"),  # no bf16 units: float32 GEMMs on widened weights
    ],
)
def test_decoder_loop_equals_the_python_layers(tiny_models, monkeypatch, kind, dtype, units, num_seqs):
    if units is not None:
        monkeypatch.setenv("BATCHSERVE_LOW_PRECISION_UNITS", units)
    _, directory = tiny_models(kind)
    config, model = load_ours(directory, dtype)
    assert model.decoder_loop is not None and model.decoder_loop.num_layers() == config.num_layers
    batch, kv = decode_step(config, num_seqs, block_size=8, dtype=dtype, seed=num_seqs)
    assert batch.attn_metadata.prefill is None and batch.attn_metadata.decode is not None

    def python_layer_ran(*args, **kwargs):
        raise AssertionError("a decode step took the Python layers")

    with monkeypatch.context() as m:
        m.setattr(DecoderLayer, "forward", python_layer_ran)
        native_hidden, native_kv = forward(model, batch, kv)
    model.decoder_loop = None
    python_hidden, python_kv = forward(model, batch, kv)
    assert native_hidden.dtype == dtype
    assert torch.equal(native_hidden, python_hidden)
    for (k1, v1), (k2, v2) in zip(native_kv, python_kv, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def test_steps_with_a_prompt_take_the_python_layers(tiny_models):
    _, directory = tiny_models("llama")
    config, model = load_ours(directory)
    batch, kv = decode_step(config, 2, block_size=8, dtype=torch.float32, seed=0)
    x = model.embed_tokens(batch.input_ids)
    assert model._takes_native_decoder_loop(x, kv, batch.attn_metadata)
    prompt = SchedulerOutput(
        new_requests=[NewRequestData("p", [5, 6, 7], 3, SamplingParams(temperature=0.0), [0], 0)],
        num_scheduled_tokens={"p": 3},
    )
    table = RequestTable(8)
    table.apply(prompt)
    prefill = table.build(prompt, torch.device("cpu"))
    assert not model._takes_native_decoder_loop(x, kv, prefill.attn_metadata)
    bf16_pool = [(k.bfloat16(), v.bfloat16()) for k, v in kv]  # the native K/V store takes the model's dtype only
    assert not model._takes_native_decoder_loop(x, bf16_pool, batch.attn_metadata)


def test_the_loop_can_be_turned_off(tiny_models, monkeypatch):
    monkeypatch.setenv("BATCHSERVE_NATIVE_DECODER_LOOP", "0")
    _, directory = tiny_models("llama")
    _, model = load_ours(directory)
    assert model.decoder_loop is None
