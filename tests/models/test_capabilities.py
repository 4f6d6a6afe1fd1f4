"""A model declares what its layers compute (layers/capabilities.py); the native decoder loop runs it only if it
implements every capability, else the Python layers run and the log says what the loop lacks."""

from __future__ import annotations

import logging

import pytest

from batchserve.layers import kernels
from batchserve.layers.capabilities import Capability
from batchserve.models import llama
from tests.models.conftest import MiniScheduler, make_runner
from tests.models.test_llama import prompt_ids
from tests.tiny_models import hf_greedy

pytestmark = pytest.mark.skipif(kernels.load() is None, reason="native kernels not built here")


def test_declared_capabilities_follow_the_config(tiny_models):
    from tests.models.conftest import load_ours

    expected = {
        "llama": {Capability.ROPE, Capability.RMS_NORM, Capability.SWIGLU, Capability.GQA},
        "llama_tied": {Capability.ROPE, Capability.RMS_NORM, Capability.SWIGLU, Capability.GQA,
                       Capability.TIED_EMBEDDINGS},
        "qwen2": {Capability.ROPE, Capability.RMS_NORM, Capability.SWIGLU, Capability.GQA, Capability.QKV_BIAS},
        "llama_attn_bias_mha": {Capability.ROPE, Capability.RMS_NORM, Capability.SWIGLU, Capability.QKV_BIAS,
                                Capability.O_BIAS},
    }  # fmt: skip
    implemented = set(kernels.load().DecoderLoop.capabilities())
    for kind, declared in expected.items():
        _, model = load_ours(tiny_models(kind)[1])
        assert model.capabilities == declared, kind
        assert {c.value for c in declared} <= implemented and model.decoder_loop is not None, kind


@pytest.mark.parametrize("planted", [Capability.QK_NORM, Capability.SLIDING_WINDOW])
def test_the_loop_refuses_a_model_with_a_capability_it_lacks(tiny_models, monkeypatch, caplog, planted):
    # The native loop does not implement `planted`: a model declaring it runs its Python layers, the start-up log names
    # what is missing, and greedy decoding still matches transformers (the tiny model does not really use it).
    assert planted.value not in kernels.load().DecoderLoop.capabilities()
    hf, directory = tiny_models("llama")
    declared = llama.model_capabilities
    monkeypatch.setattr(llama, "model_capabilities", lambda config: declared(config) | {planted})
    with caplog.at_level(logging.INFO, logger=llama.__name__):
        runner = make_runner(directory, block_size=8, num_kv_blocks=32)
    assert planted in runner.model.capabilities and runner.model.decoder_loop is None
    refusals = [r.getMessage() for r in caplog.records if "native decoder loop: off" in r.getMessage()]
    assert len(refusals) == 1 and planted.value in refusals[0]
    prompts = {"a": prompt_ids(11, 13), "b": prompt_ids(12, 5)}
    sched = MiniScheduler(runner, chunk=6)
    for req_id, prompt in prompts.items():
        sched.add(req_id, prompt, 6)
    outputs = sched.run()
    assert outputs == {req_id: hf_greedy(hf, prompt, 6) for req_id, prompt in prompts.items()}
