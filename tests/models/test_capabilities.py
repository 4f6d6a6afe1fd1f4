"""A model's capabilities (layers/capabilities.py) are read off its modules' op plan (layers/op_plan.py); the native
decoder loop runs every op kind of the plan, so it runs every family, and it refuses (logged, the Python layers running)
a plan with an op kind it does not have."""

from __future__ import annotations

import logging

import pytest

from batchserve.layers import kernels, op_plan
from batchserve.layers.capabilities import Capability
from batchserve.layers.op_plan import Op, OpKind
from tests.models.conftest import MiniScheduler, load_ours, make_runner
from tests.models.test_llama import prompt_ids
from tests.models.test_moe import MOE_KINDS, moe_models  # noqa: F401  (a fixture of the tests here)
from tests.tiny_models import hf_greedy

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="native kernels not built here")

BASE = {Capability.ROPE, Capability.RMS_NORM, Capability.SWIGLU, Capability.GQA}
GEMMA = {Capability.ROPE, Capability.RMS_NORM, Capability.GEGLU, Capability.SANDWICH_NORM, Capability.GQA,
         Capability.SLIDING_WINDOW}  # fmt: skip
EXPECTED = {
    "llama": BASE,
    "llama_tied": BASE | {Capability.TIED_EMBEDDINGS},
    "qwen2": BASE | {Capability.QKV_BIAS},
    "llama_attn_bias_mha": BASE - {Capability.GQA} | {Capability.QKV_BIAS, Capability.O_BIAS},
    "mistral_window": BASE | {Capability.SLIDING_WINDOW},
    "qwen2_window": BASE | {Capability.QKV_BIAS, Capability.SLIDING_WINDOW},
    "qwen3": BASE | {Capability.QK_NORM},
    "phi3": BASE,
    "phi4_mini": BASE | {Capability.PARTIAL_ROTARY, Capability.TIED_EMBEDDINGS},
    "gemma2": GEMMA | {Capability.SOFTCAP},
    "gemma3": GEMMA | {Capability.QK_NORM},
    "mixtral": BASE - {Capability.SWIGLU} | {Capability.MOE},
    "qwen3_moe": BASE | {Capability.MOE, Capability.QK_NORM},  # layer 1 is a dense SwiGLU MLP
}


def test_the_loop_runs_every_op_kind():
    assert set(kernels.load().DecoderLoop.op_kinds()) == {kind.value for kind in OpKind}


@pytest.mark.parametrize("kind", list(EXPECTED))
def test_capabilities_are_read_off_the_modules(tiny_models, request, kind):
    models = request.getfixturevalue("moe_models") if kind in MOE_KINDS else tiny_models
    _, model = load_ours(models(kind)[1])
    assert model.capabilities == EXPECTED[kind]
    assert model.decoder_loop is not None


def test_an_op_changes_with_its_module(tiny_models):
    """Qwen3's q/k norm inserts an op after QKV; Phi-4-mini's partial rotary is ROPE over fewer dims than a head;
    Gemma's sliding layers carry their window and table, its global ones none."""
    kinds = lambda kind: [op.kind for op in load_ours(tiny_models(kind)[1])[1].op_plan()[0]]  # noqa: E731
    assert kinds("llama") == [OpKind.RESIDUAL_NORM, OpKind.QKV, OpKind.ROPE, OpKind.ATTENTION, OpKind.O_PROJ,
                              OpKind.RESIDUAL_NORM, OpKind.SWIGLU_MLP]  # fmt: skip
    assert kinds("qwen3")[1:3] == [OpKind.QKV, OpKind.QK_NORM]
    assert kinds("gemma2") == [OpKind.RESIDUAL_NORM, OpKind.QKV, OpKind.ROPE, OpKind.ATTENTION, OpKind.O_PROJ,
                               OpKind.NORM, OpKind.RESIDUAL_NORM, OpKind.GEGLU_MLP, OpKind.NORM]  # fmt: skip
    _, phi4 = load_ours(tiny_models("phi4_mini")[1])
    (rope,) = [op for op in phi4.op_plan()[0] if op.kind == OpKind.ROPE]
    assert rope.ints[1:] == (12, 16)
    _, gemma = load_ours(tiny_models("gemma2")[1])
    attention = [next(op for op in layer if op.kind == OpKind.ATTENTION) for layer in gemma.op_plan()]
    ropes = [next(op for op in layer if op.kind == OpKind.ROPE) for layer in gemma.op_plan()]
    assert [op.ints[3] for op in attention] == [8, 0, 8, 0] and all(op.floats[1] == 5.0 for op in attention)
    assert [op.ints[0] for op in ropes] == [1, 0, 1, 0]  # sliding layers: the local table


def test_the_loop_refuses_a_plan_with_an_op_it_lacks(tiny_models, monkeypatch, caplog):
    # An op kind the native loop does not have: the model runs its Python layers, the start-up log names the op, and
    # greedy decoding still matches transformers.
    hf, directory = tiny_models("llama")
    have = op_plan.native_op_kinds
    monkeypatch.setattr(op_plan, "native_op_kinds", lambda native: have(native) - {OpKind.SWIGLU_MLP.value})
    with caplog.at_level(logging.INFO, logger=op_plan.__name__):
        runner = make_runner(directory, block_size=8, num_kv_blocks=32)
    assert runner.model.decoder_loop is None
    refusals = [r.getMessage() for r in caplog.records if "native decoder loop: off" in r.getMessage()]
    assert len(refusals) == 1 and OpKind.SWIGLU_MLP.value in refusals[0]
    prompts = {"a": prompt_ids(11, 13), "b": prompt_ids(12, 5)}
    sched = MiniScheduler(runner, chunk=6)
    for req_id, prompt in prompts.items():
        sched.add(req_id, prompt, 6)
    outputs = sched.run()
    assert outputs == {req_id: hf_greedy(hf, prompt, 6) for req_id, prompt in prompts.items()}


def test_an_op_with_the_wrong_arguments_is_refused():
    native = kernels.load()
    with pytest.raises(ValueError, match="wrong number of arguments"):
        native.DecoderLoop().add_layer([Op(OpKind.ROPE, ints=(0, 16)).export(native)])
    with pytest.raises(ValueError, match="has no op"):
        native.DecoderLoop().add_layer([("fused_everything", [], [], [], [], [])])
