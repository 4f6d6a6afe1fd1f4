"""A model that cannot fit is refused before any allocation, with the sizes in the message (host/memory.py,
engine/startup.check_memory_before_loading)."""

from __future__ import annotations

import json
import struct

import pytest

from batchserve.config import CacheConfig, ConfigError, EngineConfig
from batchserve.engine.startup import load_runner
from batchserve.host.memory import GiB, InsufficientMemoryError, min_kv_blocks, require_memory_for
from batchserve.models import loader
from batchserve.models.gguf_weights import safetensors_num_elements

HUGE_CONFIG = {  # Llama-3.1-405B-like shapes: nothing of it is ever allocated here
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 16384,
    "intermediate_size": 53248, "num_hidden_layers": 126, "num_attention_heads": 128, "num_key_value_heads": 8,
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu",
}  # fmt: skip


def header_only_safetensors(path, shapes: dict[str, list[int]]) -> None:
    """A safetensors header declaring float32 tensors of these shapes, with no data behind it."""
    header, offset = {}, 0
    for name, shape in shapes.items():
        size = 4 * shape[0] * shape[1]
        header[name] = {"dtype": "F32", "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob)


def test_the_refusal_names_weights_kv_and_available():
    with pytest.raises(InsufficientMemoryError) as info:
        require_memory_for(weights_bytes=3 * GiB, min_kv_bytes=GiB // 2, available_bytes=2 * GiB)
    assert str(info.value) == "model needs 3.00 GiB of weights + 0.50 GiB minimum KV cache; 2.00 GiB available"
    assert isinstance(info.value, ConfigError)
    require_memory_for(weights_bytes=GiB, min_kv_bytes=GiB // 2, available_bytes=2 * GiB)  # fits: no error


def test_the_minimum_pool():
    assert min_kv_blocks(num_kv_blocks=7, max_model_len=4096, block_size=16) == 7
    assert min_kv_blocks(num_kv_blocks=None, max_model_len=4097, block_size=16) == 257
    assert min_kv_blocks(num_kv_blocks=None, max_model_len=None, block_size=16) == 1


def test_a_model_larger_than_memory_is_refused_before_loading(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps(HUGE_CONFIG))
    header_only_safetensors(tmp_path / "model-00001-of-00002.safetensors", {"a": [128256, 16384], "b": [16384, 53248]})
    header_only_safetensors(
        tmp_path / "model-00002-of-00002.safetensors", {"c": [53248, 16384], "d": [1 << 20, 1 << 16]}
    )
    expected = 128256 * 16384 + 2 * 16384 * 53248 + (1 << 36)
    assert safetensors_num_elements(tmp_path) == expected

    def no_allocation(*args, **kwargs):
        raise AssertionError("load_model ran: the check must refuse before any allocation")

    monkeypatch.setattr(loader, "load_model", no_allocation)
    config = EngineConfig(model=str(tmp_path), device="cpu", dtype="bfloat16", cache=CacheConfig(num_kv_blocks=64))
    with pytest.raises(InsufficientMemoryError, match=r"model needs \d+\.\d\d GiB of weights \+ \d+\.\d\d GiB "
                       r"minimum KV cache; \d+\.\d\d GiB available") as info:  # fmt: skip
        load_runner(config)
    assert f"{expected * 2 / GiB:.2f} GiB of weights" in str(info.value)  # bfloat16: 2 bytes an element
