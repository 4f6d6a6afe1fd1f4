"""The roofline estimate against numbers worked out by hand, and its KV pool against the engine's own arithmetic."""

from __future__ import annotations

import pytest

from batchserve.simulator.analytic import (
    DEVICES,
    MODEL_SHAPES,
    Device,
    Shapes,
    kv_bytes_per_token,
    kv_pool_bytes,
    roofline_model,
)
from batchserve.simulator.shape import StepShape

# 2 layers, hidden 8, MLP 16, 2 query heads and 1 kv head of 4, vocabulary 10, tied embeddings
TINY = Shapes(name="tiny", vocab_size=10, hidden_size=8, intermediate_size=16, num_layers=2, num_heads=2, num_kv_heads=1,
              head_dim=4, max_position_embeddings=64, tie_word_embeddings=True)  # fmt: skip


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
    from batchserve.host.memory import block_bytes

    s = MODEL_SHAPES[name]  # a ModelConfig: the engine's own arithmetic takes it as it is
    assert kv_bytes_per_token(s, "bfloat16") * 16 == block_bytes(s, 16, torch.bfloat16)


LLAMA_3_8B_CONFIG = (
    '{"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,'
    ' "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192}'
)


@pytest.mark.parametrize("where", ["directory", "config.json", "other-name.json"])
def test_shapes_from_a_llama_config_json(tmp_path, where):
    model_dir = tmp_path / "Meta-Llama-3-8B"
    model_dir.mkdir()
    file = model_dir / ("config.json" if where != "other-name.json" else where)
    file.write_text(LLAMA_3_8B_CONFIG)
    s = Shapes.from_config_json(model_dir if where == "directory" else file)
    assert s.head_dim == 128 and s.layer_params == MODEL_SHAPES["llama-3-8b"].layer_params
    assert 8.0e9 < s.total_params < 8.1e9  # Llama 3 8B has 8.03 B parameters
    assert s.name == ("other-name" if where == "other-name.json" else "Meta-Llama-3-8B")
    h100, preset = DEVICES["h100-sxm"], MODEL_SHAPES["llama-3-8b"]
    assert kv_pool_bytes(s, h100, "bfloat16") == kv_pool_bytes(preset, h100, "bfloat16")
    read, expected = roofline_model(s, h100, "bfloat16"), roofline_model(preset, h100, "bfloat16")
    assert {**vars(read), "notes": None} == {**vars(expected), "notes": None}


def test_shapes_from_the_engines_gguf_match_the_preset():
    from batchserve.models.loader import ModelLoadError, default_model_path

    try:
        path = default_model_path()
    except ModelLoadError:
        pytest.skip("the default SmolLM2 GGUF is not installed")
    s, preset = Shapes.from_config_json(path), MODEL_SHAPES["smollm2-135m"]
    assert (s.layer_params, s.head_params, s.total_params) == (preset.layer_params, preset.head_params,
                                                               preset.total_params)  # fmt: skip
    assert s.max_position_embeddings == preset.max_position_embeddings


def test_an_unreadable_model_is_a_value_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama", "hidden_size": 8}')
    with pytest.raises(ValueError, match="num_attention_heads"):
        Shapes.from_config_json(tmp_path / "config.json")
    with pytest.raises(ValueError, match="not found"):
        Shapes.from_config_json(tmp_path / "missing")
