"""GGUF weights converted one tensor at a time (models/gguf_weights.py): every supported type against its source,
q/k unpermutation, the streaming safetensors cache, and the refusal of an unsupported type."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize
from safetensors import safe_open

from batchserve.models.gguf_weights import (
    SUPPORTED_TYPE_NAMES,
    UnsupportedGGUFTensor,
    gguf_cache_plan,
    gguf_num_elements,
    iter_gguf_tensors,
    unpermute_qk,
    write_gguf_as_safetensors,
)
from batchserve.models.loader import gguf_to_hf_name

ROWS, COLS = 8, 512
# max |dequantized - source| for standard-normal values (the quantization error each type has by construction)
QUANTIZED_TOLERANCE = {"F32": 0.0, "F16": 2e-3, "BF16": 2e-2, "Q8_0": 3e-2, "Q4_0": 0.5, "Q4_1": 0.35}
K_QUANTS = ("Q4_K", "Q5_K", "Q6_K")  # gguf-py dequantizes these but cannot quantize them


def source() -> np.ndarray:
    return np.random.default_rng(0).standard_normal((ROWS, COLS)).astype(np.float32)


def random_k_blocks(type_name: str, rows: int, cols: int) -> np.ndarray:
    """Raw K-quant blocks: random quants and sub-scales, with finite float16 super-block scales."""
    qtype = gguf.GGMLQuantizationType[type_name]
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    scales = rng.uniform(0.001, 0.01, size=(blocks.shape[0], 2)).astype(np.float16).view(np.uint8)
    if type_name == "Q6_K":  # d is the block's last 2 bytes
        blocks[:, -2:] = scales[:, :2]
    else:  # d, dmin are its first 4 bytes
        blocks[:, :4] = scales
    return blocks.reshape(rows, cols // block_size * type_size)


def write_gguf(path, tensors: dict[str, tuple[np.ndarray, str]]) -> gguf.GGUFReader:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, type_name) in tensors.items():
        qtype = gguf.GGMLQuantizationType[type_name]
        writer.add_tensor(name, data, raw_dtype=None if type_name == "F32" else qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return gguf.GGUFReader(str(path))


def test_the_supported_list_is_the_one_the_issue_names():
    assert set(SUPPORTED_TYPE_NAMES) == {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q5_K", "Q6_K"}


@pytest.mark.parametrize("type_name", sorted(QUANTIZED_TOLERANCE))
def test_each_quantized_type_dequantizes_to_its_source(tmp_path, type_name):
    x = source()
    data = x if type_name == "F32" else quantize(x, gguf.GGMLQuantizationType[type_name])
    reader = write_gguf(tmp_path / "m.gguf", {"blk.0.ffn_up.weight": (data, type_name)})
    [(name, tensor)] = list(iter_gguf_tensors(reader, gguf_to_hf_name, None, torch.float32))
    assert name == "model.layers.0.mlp.up_proj.weight" and tensor.shape == (ROWS, COLS)
    error = (tensor - torch.from_numpy(x)).abs().max().item()
    assert error <= QUANTIZED_TOLERANCE[type_name], error
    if type_name != "F32":
        assert error > 0  # it really went through the type's quantization


@pytest.mark.parametrize("type_name", K_QUANTS)
def test_k_quants_match_the_reference_dequantizer(tmp_path, type_name):
    blocks = random_k_blocks(type_name, ROWS, COLS)
    reader = write_gguf(tmp_path / "m.gguf", {"blk.0.ffn_down.weight": (blocks, type_name)})
    [(_, tensor)] = list(iter_gguf_tensors(reader, gguf_to_hf_name, None, torch.float32))
    expected = reference_dequantize(blocks, gguf.GGMLQuantizationType[type_name]).reshape(ROWS, COLS)
    assert tensor.shape == (ROWS, COLS) and torch.isfinite(tensor).all() and tensor.abs().max() > 0
    np.testing.assert_array_equal(tensor.numpy(), expected)


def test_q_and_k_rows_are_unpermuted_and_the_dtype_is_the_target(tmp_path):
    x = source()
    reader = write_gguf(tmp_path / "m.gguf", {"blk.0.attn_q.weight": (x, "F32"), "blk.0.attn_k.weight": (x, "F32"),
                                               "blk.0.attn_v.weight": (x, "F32")})  # fmt: skip
    got = dict(iter_gguf_tensors(reader, gguf_to_hf_name, (2, 1), torch.bfloat16))
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    q, k = got["model.layers.0.self_attn.q_proj.weight"], got["model.layers.0.self_attn.k_proj.weight"]
    assert torch.equal(q, torch.from_numpy(unpermute_qk(x, 2)).bfloat16())
    assert torch.equal(k, torch.from_numpy(unpermute_qk(x, 1)).bfloat16())
    assert not torch.equal(q, k)
    assert torch.equal(got["model.layers.0.self_attn.v_proj.weight"], torch.from_numpy(x).bfloat16())


def test_the_streamed_safetensors_cache_reads_back(tmp_path):
    x = source()
    tensors = {"token_embd.weight": (x, "F32"), "blk.0.ffn_up.weight": (quantize(x, gguf.GGMLQuantizationType.F16), "F16"),
               "blk.0.ffn_down.weight": (quantize(x, gguf.GGMLQuantizationType.Q8_0), "Q8_0"),
               "unmapped.weight": (x, "F32")}  # fmt: skip
    reader = write_gguf(tmp_path / "m.gguf", tensors)
    write_gguf_as_safetensors(reader, tmp_path / "model.safetensors", gguf_to_hf_name, None)
    expected = dict(iter_gguf_tensors(reader, gguf_to_hf_name, None))
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        assert sorted(f.keys()) == sorted(expected) and len(expected) == 3
        for name, tensor in expected.items():
            assert torch.equal(f.get_tensor(name), tensor)
    assert expected["model.layers.0.mlp.up_proj.weight"].dtype == torch.float16  # F16 stays F16 in the cache
    assert [p[0] for p in gguf_cache_plan(reader, gguf_to_hf_name)] == list(expected)
    assert gguf_num_elements(reader, gguf_to_hf_name) == 3 * ROWS * COLS


def test_an_unsupported_type_is_refused_by_name_before_any_tensor_is_converted(tmp_path):
    x = source()
    q2 = np.zeros((ROWS, COLS // 256 * gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q2_K][1]), dtype=np.uint8)
    reader = write_gguf(tmp_path / "m.gguf", {"blk.0.ffn_up.weight": (x, "F32"), "blk.0.ffn_down.weight": (q2, "Q2_K")})
    tensors = iter_gguf_tensors(reader, gguf_to_hf_name, None)
    with pytest.raises(UnsupportedGGUFTensor, match=r"'blk.0.ffn_down.weight' has type Q2_K.*Q4_K, Q5_K, Q6_K"):
        next(tensors)
