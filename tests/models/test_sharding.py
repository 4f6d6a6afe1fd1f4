"""Where each checkpoint tensor is cut for a tensor-parallel rank (models/sharding.py), without processes: the ranks'
slices put back together are the whole tensor, replicated KV heads are the ones each rank's queries read, and a size
the shapes cannot split is refused naming both numbers. The sharded models themselves run in
tests/worker/test_tensor_parallel.py (two processes)."""

from __future__ import annotations

import pytest
import torch

from batchserve.config import ConfigError, ModelConfig
from batchserve.layers.parallel import TensorParallel
from batchserve.models.sharding import ShardCutter, check_tensor_parallel, local_config


def _config(**changes) -> ModelConfig:
    shape = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=2, num_heads=4, num_kv_heads=2,
                 head_dim=16, max_position_embeddings=128)  # fmt: skip
    return ModelConfig(**{**shape, **changes})


def _shards(config: ModelConfig, name: str, tensor: torch.Tensor, size: int = 2) -> list[torch.Tensor]:
    return [
        ShardCutter(config, TensorParallel(rank, size)).take(name, tuple(tensor.shape), lambda index: tensor[index])
        for rank in range(size)
    ]


@pytest.mark.parametrize(
    ("changes", "size", "message"),
    [
        ({}, 3, "tensor_parallel_size 3 does not divide the model's num_attention_heads 4"),
        ({"intermediate_size": 90}, 4, "tensor_parallel_size 4 does not divide the model's intermediate_size 90"),
        ({"num_heads": 6, "num_kv_heads": 3}, 2, "tensor_parallel_size 2 and the model's num_key_value_heads 3"),
        ({"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 30}, 4,
         "does not divide the model's moe_intermediate_size 30"),
    ],
)  # fmt: skip
def test_a_size_the_shapes_cannot_split_is_refused_naming_both_numbers(changes, size, message):
    with pytest.raises(ConfigError, match=message):
        check_tensor_parallel(_config(**changes), size)


def test_the_local_shapes():
    local = local_config(_config(num_kv_heads=1), 2)
    assert (local.num_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (2, 1, 48, 97)


@pytest.mark.parametrize(
    ("name", "shape", "dim"),
    [
        ("model.layers.0.self_attn.q_proj.weight", (64, 64), 0),
        ("model.layers.0.self_attn.q_proj.bias", (64,), 0),
        ("model.layers.0.self_attn.k_proj.weight", (32, 64), 0),
        ("model.layers.0.self_attn.o_proj.weight", (64, 64), 1),
        ("model.layers.0.mlp.gate_proj.weight", (96, 64), 0),
        ("model.layers.0.mlp.down_proj.weight", (64, 96), 1),
        ("model.layers.0.mlp.experts.3.up_proj.weight", (96, 64), 0),
        ("model.layers.0.block_sparse_moe.experts.1.w2.weight", (64, 96), 1),
        ("model.layers.0.mlp.experts.down_proj", (4, 64, 96), 2),
    ],
)
def test_the_ranks_slices_make_the_whole_tensor(name, shape, dim):
    tensor = torch.randn(shape)
    assert torch.equal(torch.cat(_shards(_config(), name, tensor), dim=dim), tensor)


def test_fused_tensors_are_cut_part_by_part():
    """Phi-3's qkv_proj [q | k | v] and gate_up_proj [gate | up]: each rank gets its q, k and v rows (its gate and up
    rows), in that order."""
    config = _config()
    qkv = torch.arange(128.0).unsqueeze(1)  # q rows 0-63, k 64-95, v 96-127
    rank1 = _shards(config, "model.layers.0.self_attn.qkv_proj.weight", qkv)[1].squeeze(1)
    assert rank1.tolist() == list(range(32, 64)) + list(range(80, 96)) + list(range(112, 128))
    gate_up = torch.arange(192.0).unsqueeze(1)
    rank0 = _shards(config, "model.layers.0.mlp.gate_up_proj.weight", gate_up)[0].squeeze(1)
    assert rank0.tolist() == list(range(48)) + list(range(96, 144))


def test_kv_heads_fewer_than_the_ranks_are_replicated():
    """One KV head on two ranks: both hold it; two KV heads on four ranks: ranks 0-1 the first, 2-3 the second (the
    one their query heads read: query head h reads KV head h // (heads / kv heads))."""
    one_head = _config(num_heads=2, num_kv_heads=1, head_dim=32)
    k = torch.arange(32.0).unsqueeze(1)
    assert all(torch.equal(s, k) for s in _shards(one_head, "model.layers.0.self_attn.k_proj.weight", k))
    two_heads = _config(num_heads=4, num_kv_heads=2, head_dim=16)
    v = torch.arange(32.0).unsqueeze(1)
    shards = _shards(two_heads, "model.layers.0.self_attn.v_proj.weight", v, size=4)
    assert [s[0, 0].item() for s in shards] == [0.0, 0.0, 16.0, 16.0]


def test_vocabulary_rows_are_padded_and_o_proj_bias_is_rank_0s():
    config = _config()  # 97 tokens on two ranks: 49 rows each, the last one padding on rank 1
    table = torch.randn(97, 64)
    first, second = _shards(config, "model.embed_tokens.weight", table)
    assert first.shape == second.shape == (49, 64)
    assert torch.equal(torch.cat((first, second[:48])), table) and not second[48].any()
    bias = torch.randn(64)
    zero, one = _shards(config, "model.layers.0.self_attn.o_proj.bias", bias)
    assert torch.equal(zero, bias) and not one.any()
