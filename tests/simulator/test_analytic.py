"""The roofline estimate against numbers worked out by hand, and its KV pool against the engine's own arithmetic."""

from __future__ import annotations

import pytest

from batchserve.simulator.analytic import (
    MODEL_SHAPES,
    Device,
    Shapes,
    kv_bytes_per_token,
    kv_pool_bytes,
    roofline_model,
)
from batchserve.simulator.shape import StepShape

# 2 layers, hidden 8, MLP 16, 2 query heads and 1 kv head of 4, vocabulary 10, tied embeddings
TINY = Shapes("tiny", 8, 16, 2, 2, 1, 4, 10, True, 64)


def device(bandwidth: float) -> Device:
    return Device("toy", peak_flops=1000.0, bandwidth=bandwidth, memory_bytes=10_000, compute_efficiency=1.0,
                  bandwidth_efficiency=1.0, overhead_s=0.5, overhead_per_seq_s=0.0)  # fmt: skip


def test_per_layer_arithmetic_by_hand():
    # q 8x8 + k,v 2 x 8x4 + o 8x8 + MLP 3 x 8x16 = 64 + 64 + 64 + 384
    assert TINY.layer_params == 576
    assert TINY.total_params == 2 * 576 + 10 * 8  # tied: the head is the embedding, counted once
    m = roofline_model(TINY, device(100.0), "float32")
    assert m.flops_per_token == 2 * 2 * 576 == 2304
    assert m.flops_per_sample == 2 * 10 * 8 == 160
    assert m.flops_per_pair == 4 * 2 * 2 * 4 == 64  # QK^T and PV: 2 x head_dim each, per head, per layer
    assert m.weight_bytes == (2 * 576 + 80) * 4 == 4928
    assert m.kv_bytes_per_token == 2 * 2 * 1 * 4 * 4 == 64


def test_decode_step_is_memory_bound_by_hand():
    # one sequence decoding its 10th token: reads 10 K/V positions, writes 1
    shape = StepShape(tokens=1, seqs=1, samples=1, decode_ctx=10)
    m = roofline_model(TINY, device(100.0), "float32")
    flops = 2304 + 160 + 64 * 10  # 3104 -> 3.104 s at 1000 FLOP/s
    bytes_ = 4928 + (10 + 1) * 64  # 5632 -> 56.32 s at 100 B/s: memory-bound
    assert m.flops(shape) == flops and m.bytes(shape) == bytes_
    assert m.predict(shape) == pytest.approx(56.32 + 0.5)


def test_prefill_step_is_compute_bound_by_hand():
    # a 20-token prompt in one chunk: 20 x 21 / 2 causal query-key pairs, 20 positions read and written
    shape = StepShape(tokens=20, seqs=1, samples=1, prefill_pairs=210, prefill_ctx=20)
    m = roofline_model(TINY, device(1000.0), "float32")
    assert m.flops(shape) == 2304 * 20 + 160 + 64 * 210 == 59680  # 59.68 s
    assert m.bytes(shape) == 4928 + 40 * 64 == 7488  # 7.488 s
    assert m.predict(shape) == pytest.approx(59.68 + 0.5)


def test_kv_pool_follows_the_memory_left_after_the_weights():
    free, pool = kv_pool_bytes(TINY, device(100.0), "float32")
    assert free == 10_000 - 4928
    assert pool == int(free * 0.9)  # the GPU default fraction, as worker/kv_cache.py
    with pytest.raises(ValueError, match="does not fit"):
        kv_pool_bytes(MODEL_SHAPES["llama-3-8b"], device(1.0), "bfloat16")


@pytest.mark.parametrize("name", sorted(MODEL_SHAPES))
def test_kv_bytes_equal_the_engines_block_bytes(name):
    torch = pytest.importorskip("torch")
    from batchserve.config import ModelConfig
    from batchserve.worker.kv_cache import block_bytes

    s = MODEL_SHAPES[name]
    mc = ModelConfig(s.vocab_size, s.hidden_size, s.intermediate_size, s.num_layers, s.num_heads, s.num_kv_heads,
                     s.head_dim, s.max_position_embeddings)  # fmt: skip
    assert kv_bytes_per_token(s, "bfloat16") * 16 == block_bytes(mc, 16, torch.bfloat16)


def test_shapes_from_a_llama_config_json(tmp_path):
    (tmp_path / "config.json").write_text(
        '{"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,'
        ' "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192}'
    )
    s = Shapes.from_config_json(tmp_path)
    assert s.head_dim == 128 and s.layer_params == MODEL_SHAPES["llama-3-8b"].layer_params
    assert 8.0e9 < s.total_params < 8.1e9  # Llama 3 8B has 8.03 B parameters
