"""Steps with LoRA adapters in the native decoder loop (kernels/decoder_loop.cpp adds each projection's deltas with
the native LoRA kernel, before SwiGLU or GeGLU reads gate/up and before RoPE reads q/k) against the Python sequencing
(layers/lora.py project in each layer): a mixed step's rows and K/V bit for bit, float32 and bfloat16, on every LoRA
kernel path this host runs, over float32, bf16 (oneDNN, AMX, widened) and quantized base weights; the adapters
change their rows and leave the base model's alone (on AMX: gate/up's plain product then SwiGLU, bit for bit the
fused kernel's)."""

from __future__ import annotations

import pytest
import torch

from batchserve.layers import kernels, quantization
from batchserve.layers.linear import layout_policy
from batchserve.layers.lora import LoRAGroup, LoRAStep
from batchserve.models.lora_adapters import target_shapes
from batchserve.worker.lora_slots import PROJECTIONS, LoRAPool
from tests.models.conftest import load_ours
from tests.models.test_decoder_loop import (
    _check_gemm_layouts,
    _force_units,
    assert_same,
    forward,
    native_forward,
    step_batch,
)

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="native kernels not built here")

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# slot -> (rank, targets): every projection; some slices of the fused ones; one slice of each fused projection
ADAPTERS = {0: (8, ALL), 1: (4, ("q_proj", "v_proj", "down_proj")), 2: (2, ("k_proj", "up_proj", "o_proj"))}


def attach_adapters(model, config, dtype: torch.dtype, seed: int) -> LoRAPool:
    """A pool of three slots on `model` (which rebuilds its native loop with them), filled with random adapters."""
    pool = LoRAPool(model, config, max_loras=3, max_rank=8, max_cpu_loras=3, dtype=dtype, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(seed)
    shapes = target_shapes(config)
    for slot, (rank, targets) in ADAPTERS.items():
        for layer in pool.layers:
            for path, names in PROJECTIONS:
                parts = []
                for name in names:
                    out_features, in_features = shapes[name]
                    a = torch.randn(rank, in_features, generator=g) / in_features**0.5
                    parts.append((a, torch.randn(out_features, rank, generator=g)) if name in targets else None)
                layer[path[1]].load(slot, parts, rank)
    return pool


def group(slot: int, rows: list[int]) -> LoRAGroup:
    contiguous = rows == list(range(rows[0], rows[0] + len(rows)))
    rank = ADAPTERS[slot][0]
    return LoRAGroup(slot, rank, 1.5, torch.tensor(rows, dtype=torch.int64), rows[0] if contiguous else -1)


# 5 decodes (rows 0-4), then chunks of 13 (rows 5-17), 6 (18-23) and 9 (24-32) rows: adapter 0 on two decodes and a
# prompt (scattered rows), adapter 1 on a decode and a chunk after context, adapter 2 on the last chunk (contiguous)
PROMPTS = ((0, 13), (11, 6), (16, 9))
STEP = ((0, [0, 2, *range(5, 18)]), (1, [1, *range(18, 24)]), (2, list(range(24, 33))))
BASE_ROWS = [3, 4]


def check_loop_equals_python(model, config, dtype, monkeypatch) -> None:
    assert model._loop_takes_lora and model.decoder_loop is not None
    batch, kv = step_batch(config, 5, 8, dtype, seed=11, prompts=PROMPTS)
    batch.attn_metadata.lora = LoRAStep(tuple(group(slot, rows) for slot, rows in STEP))
    native_hidden, native_kv = native_forward(model, batch, kv, monkeypatch)  # a Python layer would fail the test
    loop, model.decoder_loop = model.decoder_loop, None
    python_hidden, python_kv = forward(model, batch, kv)
    assert native_hidden.dtype == dtype
    assert_same(native_hidden, native_kv, python_hidden, python_kv)
    model.decoder_loop, batch.attn_metadata.lora = loop, None
    base_hidden, _ = forward(model, batch, kv)
    changed = (base_hidden != native_hidden).any(dim=1)
    assert changed[[r for _, rows in STEP for r in rows]].all() and not changed[BASE_ROWS].any()


@pytest.mark.parametrize("path", ["avx512_bf16", "avx512", "avx2", "portable"])
@pytest.mark.parametrize(
    "kind,dtype,units",
    [
        ("llama", torch.float32, None),
        ("qwen2", torch.float32, None),  # q/k/v biases
        ("gemma3", torch.float32, None),  # GeGLU, q/k norms, sliding layers
        ("llama", torch.bfloat16, "1"),  # oneDNN's packed bf16 GEMMs
        ("llama", torch.bfloat16, "amx_emulated"),  # gate/up in the AMX kernel's swiglu order: the deltas added there
        ("llama", torch.bfloat16, "amx"),
        ("qwen2", torch.bfloat16, "0"),  # no bf16 units: float32 GEMMs on widened weights
        ("gemma3", torch.bfloat16, "1"),
    ],
)
def test_steps_with_adapters_run_the_loop_bit_for_bit(
    tiny_models, monkeypatch, force_gemm, force_lora_path, kind, dtype, units, path
):
    _force_units(monkeypatch, force_gemm, units)
    force_lora_path(path)
    _, directory = tiny_models(kind)
    config, model = load_ours(directory, dtype)
    if kind == "llama":  # on AMX, gate/up in swiglu panels: its plain product's columns put back in order
        _check_gemm_layouts(model, units)
    attach_adapters(model, config, dtype, seed=len(kind))
    check_loop_equals_python(model, config, dtype, monkeypatch)


@pytest.mark.parametrize("scheme,dtype", [("int8", torch.float32), ("int4", torch.bfloat16)])
def test_adapters_on_quantized_base_weights(tiny_models, monkeypatch, scheme, dtype):
    _, directory = tiny_models("llama")
    with layout_policy(quantization.linear_policy(scheme, dtype=dtype)):
        config, model = load_ours(directory, dtype)
    assert isinstance(model.layers[0].self_attn.qkv_proj, quantization.QuantizedLinear)
    attach_adapters(model, config, dtype, seed=5)
    check_loop_equals_python(model, config, dtype, monkeypatch)


def test_a_loop_built_without_slots_leaves_adapter_steps_to_the_python_layers(tiny_models, monkeypatch):
    """A loop built before the slots were attached (no refresh) has no deltas to add: such a step runs the Python
    layers rather than the base model."""
    _, directory = tiny_models("llama")
    config, model = load_ours(directory)
    monkeypatch.setattr(type(model), "refresh_decoder_loop", lambda self: None)
    attach_adapters(model, config, torch.float32, seed=1)
    assert not model._loop_takes_lora
    batch, kv = step_batch(config, 5, 8, torch.float32, seed=11, prompts=PROMPTS)
    batch.attn_metadata.lora = LoRAStep(tuple(group(slot, rows) for slot, rows in STEP))
    with pytest.raises(AssertionError, match="took the Python layers"):
        native_forward(model, batch, kv, monkeypatch)
