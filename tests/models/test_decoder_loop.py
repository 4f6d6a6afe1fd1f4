"""The native decoder loop (kernels/decoder_loop.cpp) against the Python layers it stands in for: it runs the model's
op plan (layers/op_plan.py) with the operators the Python layers call (layer_ops.h, composed_ops.cpp) in the same
order, so the hidden states and the K/V it writes must be bit for bit the same, for every model family, on every
attention path, whatever GEMM path the rows take (x @ W, the small-M kernel, oneDNN packed, bf16 rows padded to 4, the
AMX kernel or its emulation)."""

from __future__ import annotations

import pytest
import torch

from batchserve.core.outputs import NewRequestData, SchedulerOutput
from batchserve.layers import kernels, windowed_attention
from batchserve.layers.attention import PREFILL_KERNEL_PATHS, native_step, preferred_prefill_method, prefill_method
from batchserve.layers.kernels import paths
from batchserve.layers.linear import CpuLinear
from batchserve.layers.moe import SparseMoE
from batchserve.models import llama
from batchserve.models.gemma import GemmaDecoderLayer
from batchserve.models.llama import DecoderLayer
from batchserve.sampling_params import SamplingParams
from batchserve.worker.input_batch import RequestTable
from tests.models.conftest import load_ours
from tests.models.test_moe import MOE_KINDS, moe_models  # noqa: F401  (a fixture of the tests here)
from tests.tiny_models import VOCAB

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="native kernels not built here")


def step_batch(config, num_seqs: int, block_size: int, dtype: torch.dtype, seed: int, prompts: tuple = ()):
    """A step of `num_seqs` decodes, each over a context of random K/V in scattered blocks, plus one prefill chunk
    per (context, chunk length) in `prompts` (context 0: a fresh prompt)."""
    g = torch.Generator().manual_seed(seed)
    seqs = [(n - 1, 1) for n in torch.randint(1, 60, (num_seqs,), generator=g).tolist()] + list(prompts)
    num_blocks = sum(-(-(context + n) // block_size) for context, n in seqs) + 1
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    kv = [(torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype))
          for _ in range(config.num_layers)]  # fmt: skip
    free = torch.randperm(num_blocks, generator=g).tolist()
    new = []
    for i, (context, n) in enumerate(seqs):
        need = -(-(context + n) // block_size)
        blocks, free = free[:need], free[need:]
        tokens = torch.randint(3, VOCAB, (context + n,), generator=g).tolist()
        new.append(NewRequestData(f"r{i}", tokens, context + n, SamplingParams(temperature=0.0), blocks, context))
    out = SchedulerOutput(new_requests=new, num_scheduled_tokens={r.req_id: n for r, (_, n) in zip(new, seqs)})
    table = RequestTable(block_size)
    table.apply(out)
    return table.build(out, torch.device("cpu")), kv


def decode_step(config, num_seqs: int, block_size: int, dtype: torch.dtype, seed: int):
    return step_batch(config, num_seqs, block_size, dtype, seed)


def forward(model, batch, kv):
    caches = [(k.clone(), v.clone()) for k, v in kv]
    with torch.inference_mode():
        hidden = model(batch.input_ids, batch.positions, caches, batch.attn_metadata)
    return hidden, caches


def assert_same(hidden, kv, other_hidden, other_kv) -> None:
    """The same hidden states and the same K/V in the pool, bit for bit."""
    assert torch.equal(hidden, other_hidden)
    for (k1, v1), (k2, v2) in zip(kv, other_kv, strict=True):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)


def _force_units(monkeypatch, force_gemm, units: str | None) -> None:
    """units: None (the CPU decides), "1"/"0" (bf16 matmul units or not, oneDNN's GEMM on them) or a GEMM path."""
    if units == "amx" and not kernels.gemm_path_runs("amx"):
        pytest.skip("this CPU has no AMX (amx_bf16)")
    if units == "avx512_bf16" and not kernels.gemm_path_runs("avx512_bf16"):
        pytest.skip("this CPU has no AVX512-BF16")
    if units in kernels.GEMM_PATHS:
        force_gemm(units)
    elif units is not None:
        monkeypatch.setenv("BATCHSERVE_LOW_PRECISION_UNITS", units)
        if units == "1":
            force_gemm("onednn")  # oneDNN's packed GEMM, as on bf16 units without AMX
    probe = CpuLinear(torch.zeros(32, 32, dtype=torch.bfloat16))
    if units not in (None, "0") and not (probe.packed_only or probe.bf16_pairs):
        # the bf16-units path stands on oneDNN's packed bf16 GEMM, which this torch has only on AVX-512 CPUs:
        # forced units would leave every layer on the widened float32 path (AVX2-only hosts)
        pytest.skip("this torch build has no oneDNN bf16 linear")


def _check_gemm_layouts(model, units: str | None) -> None:
    """Every projection has the AMX layout exactly when the AMX kernel (or its emulation) was forced."""
    gate_up = model.layers[0].mlp.gate_up_proj
    assert (gate_up.amx_packed is not None) == (units in ("amx", "amx_emulated"))
    assert gate_up.swiglu == (units in ("amx", "amx_emulated"))  # silu(gate) * up in the AMX kernel's epilogue


def native_forward(model, batch, kv, monkeypatch):
    """forward() through the native loop: a call of the Python layers fails the test."""

    def python_layer_ran(*args, **kwargs):
        raise AssertionError("the step took the Python layers")

    with monkeypatch.context() as m:
        for layer_class in (DecoderLayer, GemmaDecoderLayer):
            m.setattr(layer_class, "forward", python_layer_ran)
        return forward(model, batch, kv)


@pytest.mark.parametrize("num_seqs", [1, 3, 7, 70])
@pytest.mark.parametrize(
    "kind,dtype,units",
    [
        ("llama", torch.float32, None),
        ("qwen2", torch.float32, None),  # q/k/v biases
        ("llama_attn_bias_mha", torch.float32, None),  # o_proj bias, no GQA, head size 8
        ("llama_tied", torch.bfloat16, "1"),  # oneDNN bf16 GEMMs on packed weights, fewer than 4 rows padded
        ("qwen2", torch.bfloat16, "1"),
        ("qwen2", torch.bfloat16, "amx_emulated"),  # q/k/v biases in the AMX kernel's epilogue
        ("qwen2", torch.bfloat16, "avx512_bf16"),  # bf16 pairs for decode-sized rows, oneDNN above (no AMX)
        ("llama", torch.bfloat16, "0"),  # no bf16 units: float32 GEMMs on widened weights
        ("llama", torch.bfloat16, "amx_emulated"),  # the AMX kernel's tile operations in scalar code, on any CPU
        ("llama", torch.bfloat16, "amx"),  # on AMX tiles, where the CPU has them
    ],
)
def test_decoder_loop_equals_the_python_layers(tiny_models, monkeypatch, force_gemm, kind, dtype, units, num_seqs):
    _force_units(monkeypatch, force_gemm, units)
    _, directory = tiny_models(kind)
    config, model = load_ours(directory, dtype)
    _check_gemm_layouts(model, units)
    assert model.decoder_loop is not None and model.decoder_loop.num_layers() == config.num_layers
    batch, kv = decode_step(config, num_seqs, block_size=8, dtype=dtype, seed=num_seqs)
    assert batch.attn_metadata.prefill is None and batch.attn_metadata.decode is not None

    native_hidden, native_kv = native_forward(model, batch, kv, monkeypatch)
    model.decoder_loop = None
    python_hidden, python_kv = forward(model, batch, kv)
    assert native_hidden.dtype == dtype
    assert_same(native_hidden, native_kv, python_hidden, python_kv)


@pytest.mark.parametrize("num_seqs", [5, 20])
def test_rows_above_the_amx_limit_take_onednn_then_silu_and_mul(tiny_models, monkeypatch, force_gemm, num_seqs):
    """The fused gate/up kernel below CpuLinear.AMX_MAX_M (5 rows), oneDNN and the separate silu_and_mul above it
    (20): the same in the loop as in the Python layers."""
    monkeypatch.setattr(CpuLinear, "AMX_MAX_M", 8)
    _force_units(monkeypatch, force_gemm, "amx_emulated")
    _, directory = tiny_models("llama")
    config, model = load_ours(directory, torch.bfloat16)
    _check_gemm_layouts(model, "amx_emulated")
    batch, kv = decode_step(config, num_seqs, block_size=8, dtype=torch.bfloat16, seed=num_seqs)
    native_hidden, native_kv = native_forward(model, batch, kv, monkeypatch)
    model.decoder_loop = None
    python_hidden, python_kv = forward(model, batch, kv)
    assert_same(native_hidden, native_kv, python_hidden, python_kv)


@pytest.mark.parametrize("num_seqs", [3, 21])
def test_the_mlp_in_row_tiles_is_the_same_in_the_loop_as_in_the_python_layers(
    tiny_models, monkeypatch, force_gemm, num_seqs
):
    """With CpuLinear.SWIGLU_TILE_M at 4 a step of 21 rows runs its MLP in 6 tiles (3 rows: one): the loop and the
    Python layers call the same swiglu_mlp."""
    monkeypatch.setattr(CpuLinear, "AMX_MAX_M", 8)
    monkeypatch.setattr(CpuLinear, "SWIGLU_TILE_M", 4)
    _force_units(monkeypatch, force_gemm, "amx_emulated")
    _, directory = tiny_models("llama")
    config, model = load_ours(directory, torch.bfloat16)
    assert model.layers[0].mlp.gate_up_proj.rows.swiglu_tile_m == 4
    batch, kv = decode_step(config, num_seqs, block_size=8, dtype=torch.bfloat16, seed=num_seqs)
    native_hidden, native_kv = native_forward(model, batch, kv, monkeypatch)
    model.decoder_loop = None
    python_hidden, python_kv = forward(model, batch, kv)
    assert_same(native_hidden, native_kv, python_hidden, python_kv)


@pytest.mark.parametrize("num_seqs", [0, 1, 5])
@pytest.mark.parametrize("prefill", ["sdpa", "native", "split"])
@pytest.mark.parametrize(
    "kind,dtype,units",
    [
        ("llama_head64", torch.float32, None),
        ("llama_head64", torch.bfloat16, "1"),
        ("llama_head64", torch.bfloat16, "0"),
        ("llama_head64", torch.bfloat16, "amx_emulated"),
        ("qwen2", torch.bfloat16, "1"),  # head size 16: the native prefill kernel does not take it
        ("llama_attn_bias_mha", torch.float32, None),  # head size 8
    ],
)
def test_steps_with_prompts_equal_the_python_layers(
    tiny_models, monkeypatch, force_prefill, force_gemm, kind, dtype, units, prefill, num_seqs
):
    """Mixed steps: decodes, a fresh prompt, chunks after earlier context (mid-block and on a block edge); "split"
    with its threshold at 8 rows: the 6-row chunk by the native kernel, the 13- and 9-row ones by SDPA."""
    monkeypatch.setattr(paths, "SHORT_PREFILL_MAX_ROWS", 8)
    if prefill != "sdpa" and kernels.attention_path().name not in PREFILL_KERNEL_PATHS:
        pytest.skip("the native prefill kernel needs an AVX-512 attention path")
    _force_units(monkeypatch, force_gemm, units)
    force_prefill(prefill)
    _, directory = tiny_models(kind)
    config, model = load_ours(directory, dtype)
    _check_gemm_layouts(model, units)
    batch, kv = step_batch(config, num_seqs, 8, dtype, seed=num_seqs, prompts=((0, 13), (11, 6), (16, 9)))
    assert batch.attn_metadata.prefill is not None
    # a head size the native prefill kernel was not built for attends by SDPA, in the loop as in the Python layers
    expected_mode = prefill if kernels.load().prefill_attention_available(config.head_dim) else "sdpa"
    assert prefill_method(model.embed_tokens(batch.input_ids), config.head_dim, kv[0]) == expected_mode
    native_hidden, native_kv = native_forward(model, batch, kv, monkeypatch)
    model.decoder_loop = None
    python_hidden, python_kv = forward(model, batch, kv)
    assert_same(native_hidden, native_kv, python_hidden, python_kv)


@pytest.mark.parametrize("num_seqs", [1, 30, 100, 520])
@pytest.mark.parametrize(
    "dtype,units", [(torch.float32, None), (torch.bfloat16, "1"), (torch.bfloat16, "amx_emulated")]
)
def test_a_wide_projection_takes_every_gemm_path(tiny_models, monkeypatch, force_gemm, dtype, units, num_seqs):
    """gate/up wider than CpuLinear.NARROW_OUT has oneDNN's packed layout in float32 as well: by rows it takes
    x @ W (1), the small-M kernel (30, where built; on a CPU that runs AVX-512 in two halves, oneDNN's brgemm on the
    same panels at 30 and 100), oneDNN packed (100 elsewhere) and x @ W again (520). With the AMX kernel forced, the
    projections whose shape it takes (qkv, o) run on it and the others (gate/up, down) on oneDNN."""
    _force_units(monkeypatch, force_gemm, units)
    _, directory = tiny_models("llama_wide_mlp")
    config, model = load_ours(directory, dtype)
    gate_up = model.layers[0].mlp.gate_up_proj
    assert gate_up.out_features > CpuLinear.NARROW_OUT and gate_up.packed is not None
    assert gate_up.packed_only == (dtype == torch.bfloat16)
    if dtype == torch.float32 and kernels.small_gemm_path() != "library":
        assert gate_up.small_packed is not None
    attention = model.layers[0].self_attn
    assert gate_up.amx_packed is None and (attention.qkv_proj.amx_packed is not None) == (units == "amx_emulated")
    batch, kv = decode_step(config, num_seqs, block_size=8, dtype=dtype, seed=num_seqs)
    native_hidden, native_kv = native_forward(model, batch, kv, monkeypatch)
    model.decoder_loop = None
    python_hidden, python_kv = forward(model, batch, kv)
    assert_same(native_hidden, native_kv, python_hidden, python_kv)


def test_a_pool_of_another_dtype_takes_the_python_layers(tiny_models):
    # a guard: the engine allocates its pool in the model's dtype (the Python layers' native K/V store needs that too)
    _, directory = tiny_models("llama")
    config, model = load_ours(directory)
    batch, kv = decode_step(config, 2, block_size=8, dtype=torch.float32, seed=0)
    x = model.embed_tokens(batch.input_ids)
    assert native_step(x, config.head_dim, kv[0], batch.attn_metadata) is not None
    bf16_pool = [(k.bfloat16(), v.bfloat16()) for k, v in kv]  # the native K/V store takes the model's dtype only
    assert native_step(x, config.head_dim, bf16_pool[0], batch.attn_metadata) is None


def test_the_loop_can_be_turned_off(tiny_models, monkeypatch):
    monkeypatch.setenv("BATCHSERVE_NATIVE_DECODER_LOOP", "0")
    _, directory = tiny_models("llama")
    _, model = load_ours(directory)
    assert model.decoder_loop is None


# One kind of each family, and the variants that change an op: a window on every layer (Mistral, Mixtral, Phi-3-mini
# 4k) or on some (Qwen's use_sliding_window, Gemma's sliding layers), soft-capped scores (Gemma 2), q/k norms (Qwen3,
# Gemma 3, Qwen3-MoE), partial rotary (Phi-4-mini), LongRoPE (Phi-3), MoE MLPs with dense layers between (Qwen3-MoE),
# GeGLU and sandwich norms (Gemma).
FAMILY_KINDS = ("llama", "qwen2", "mistral_window", "qwen2_window", "qwen3", "phi3", "phi3_window", "phi4_mini",
                "gemma2", "gemma3", "gemma3_tied", "mixtral", "mixtral_window", "qwen3_moe", "qwen3_moe_norm_topk")  # fmt: skip


@pytest.fixture
def family_model(tiny_models, request):
    """kind -> the saved folder of its tiny random model."""
    moe = request.getfixturevalue("moe_models")
    return lambda kind: (moe if kind in MOE_KINDS else tiny_models)(kind)[1]


@pytest.fixture
def force_attention_path(monkeypatch):
    """force_attention_path(path): the native attention kernels take `path` (skipped where it cannot run here),
    prefill chunks the native prefill kernel where that path has one."""

    def force(path: str) -> None:
        if not kernels.attention_path_runs(path):
            pytest.skip(f"attention path {path!r} cannot run on this CPU")
        monkeypatch.setenv("BATCHSERVE_ATTENTION_PATH", path)
        monkeypatch.setenv("BATCHSERVE_PREFILL_ATTENTION", "native")
        kernels.attention_path.cache_clear()
        preferred_prefill_method.cache_clear()

    yield force
    kernels.attention_path.cache_clear()
    preferred_prefill_method.cache_clear()


@pytest.mark.parametrize("path", ["avx512_bf16", "avx512", "portable"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kind", FAMILY_KINDS)
def test_every_family_runs_the_native_loop_bit_for_bit(family_model, force_attention_path, monkeypatch, kind, dtype,
                                                       path):  # fmt: skip
    """Decodes over contexts longer than the windows (8), a fresh prompt, chunks after earlier context: the loop's
    rows and K/V are the Python layers'."""
    force_attention_path(path)
    config, model = load_ours(family_model(kind), dtype)
    assert model.decoder_loop is not None and model.decoder_loop.num_layers() == config.num_layers
    batch, kv = step_batch(config, 5, 8, dtype, seed=len(kind), prompts=((0, 13), (11, 6), (16, 9)))
    native_hidden, native_kv = native_forward(model, batch, kv, monkeypatch)
    model.decoder_loop = None
    python_hidden, python_kv = forward(model, batch, kv)
    assert native_hidden.dtype == dtype
    assert_same(native_hidden, native_kv, python_hidden, python_kv)


@pytest.mark.parametrize("kind", ["gemma2", "mistral_window"])
def test_windowed_prefill_in_query_tiles(family_model, monkeypatch, kind):
    """A prompt longer than the windowed attention's query tile (4 here) attends tile by tile in both sequencings."""
    monkeypatch.setattr(windowed_attention, "QUERY_TILE", 4)
    monkeypatch.setattr(llama, "QUERY_TILE", 4)  # the tile the plan hands the native loop
    config, model = load_ours(family_model(kind))
    batch, kv = step_batch(config, 2, 8, torch.float32, seed=3, prompts=((0, 23), (13, 10)))
    native_hidden, native_kv = native_forward(model, batch, kv, monkeypatch)
    model.decoder_loop = None
    python_hidden, python_kv = forward(model, batch, kv)
    assert_same(native_hidden, native_kv, python_hidden, python_kv)


def test_the_moe_loop_runs_each_expert_on_its_tokens(family_model, monkeypatch):
    """A decode batch routed over all of Qwen3-MoE's experts: the MoE op's grouping, weighting and scatter-add are the
    Python block's."""
    config, model = load_ours(family_model("qwen3_moe"))
    batch, kv = decode_step(config, 40, block_size=8, dtype=torch.float32, seed=7)
    routed = set()
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.gate.register_forward_hook(lambda module, args, out: routed.update(out[1].reshape(-1).tolist()))
    native_hidden, native_kv = native_forward(model, batch, kv, monkeypatch)
    assert not routed, "the native loop routes in C++"
    model.decoder_loop = None
    python_hidden, python_kv = forward(model, batch, kv)
    assert routed == set(range(config.num_experts))
    assert_same(native_hidden, native_kv, python_hidden, python_kv)
