"""benchmarks/scale_gguf.py: model_scale.py's random Llama checkpoint written as a GGUF file holds the checkpoint's
weights in the type asked (each tensor's codes are gguf's quantization of the checkpoint's, q/k rows in llama.cpp's
order), batchserve serves the file as stored with transformers' greedy tokens on those weights, and llama.cpp computes
transformers' logits from it. The weights are drawn wide (std 0.15) so that attention is peaked: with q/k rows left in
HF's order llama.cpp's logits are off by more than their own scale, not within the format's error."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import transformers

from batchserve import LLM, SamplingParams
from batchserve.layers import quantization
from batchserve.layers.linear import CpuLinear
from batchserve.models.gguf_config import read_gguf_config
from batchserve.models.gguf_weights import unpermute_qk
from batchserve.models.hf_config import read_hf_config
from tests.tiny_models import hf_greedy

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
PROMPTS = [[5, 17, 33, 8, 61, 40, 41], [9, 100, 200, 300]]
TOKENS = 6


@pytest.fixture(scope="module")
def scripts():
    import sys

    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("model_scale"), importlib.import_module("scale_gguf")
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.fixture(scope="module")
def checkpoint(scripts, tmp_path_factory) -> Path:
    """A tiny random bf16 Llama (Llama 3's rope scaling, GQA) and its GGUF files."""
    model_scale, scale_gguf = scripts
    shapes = model_scale.Shapes("tiny", vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2,
                                num_heads=4, num_kv_heads=2, head_dim=16, hf_extra=model_scale.LLAMA3_ROPE)  # fmt: skip
    folder = tmp_path_factory.mktemp("scale_gguf")
    model_scale.write_checkpoint(shapes, folder, torch.bfloat16, std=0.15)
    scale_gguf.write_ggufs(folder, ["Q8_0", "Q4_0", "Q4_1"])
    return folder


def roundtrip(weights: np.ndarray, type_name: str) -> np.ndarray:
    qtype = gguf.GGMLQuantizationType[type_name]
    return gguf.quants.dequantize(gguf.quants.quantize(weights, qtype), qtype).reshape(weights.shape)


def quantized_transformers(folder: Path, type_name: str):
    """transformers' Llama on the checkpoint, every matrix replaced by gguf's quantize -> dequantize of it."""
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:
                param.copy_(torch.from_numpy(roundtrip(param.numpy(), type_name)))
    return model


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0", "Q4_1"])
def test_each_tensor_holds_the_checkpoints_weights_quantized(scripts, checkpoint, type_name):
    _, scale_gguf = scripts
    path = scale_gguf.gguf_path(checkpoint, type_name)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    config = json.loads((checkpoint / "config.json").read_text())
    heads = {"q_proj": config["num_attention_heads"], "k_proj": config["num_key_value_heads"]}
    from safetensors.torch import load_file

    (shard,) = checkpoint.glob("*.safetensors")
    for name, weights in load_file(str(shard)).items():
        tensor = tensors.pop(scale_gguf.gguf_name(name))
        want = weights.float().numpy()
        assert tensor.tensor_type.name == (type_name if want.ndim == 2 else "F32"), name
        got = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(want.shape)
        projection = name.split(".")[-2]
        if projection in heads:
            got = unpermute_qk(got, heads[projection])
        np.testing.assert_array_equal(got, roundtrip(want, type_name) if want.ndim == 2 else want, err_msg=name)
    assert list(tensors) == ["rope_freqs.weight"]  # Llama 3's scaling, as llama.cpp's converter writes it
    ours, hf = read_gguf_config(path), read_hf_config(checkpoint)
    for field in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads",
                  "head_dim", "tie_word_embeddings", "bos_token_id", "architecture"):  # fmt: skip
        assert getattr(ours, field) == getattr(hf, field), field
    for field in ("rms_norm_eps", "rope_theta"):  # float32 in GGUF metadata
        assert getattr(ours, field) == np.float32(getattr(hf, field)), field
    assert ours.eos_token_ids == hf.eos_token_ids
    assert reader.fields["general.file_type"].contents() == scale_gguf.FILE_TYPES[type_name]
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == config["vocab_size"]


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_0"])
def test_batchserve_serves_the_file_as_stored_with_transformers_tokens(scripts, checkpoint, monkeypatch, type_name):
    """quantization gguf, the checkpoint's own tokenizer; the weight-only kernel path (W8A8 rounds activations too)."""
    if quantization.quant_gemm_path_runs("avx512"):
        monkeypatch.setenv("BATCHSERVE_QUANT_GEMM_PATH", "avx512")
    quantization.quant_gemm_path.cache_clear()
    laid_out = []  # the float matrices given CPU layouts
    init = CpuLinear.__init__
    monkeypatch.setattr(
        CpuLinear, "__init__", lambda self, w, *a, **k: laid_out.append(w.shape) or init(self, w, *a, **k)
    )
    try:
        llm = LLM(model=str(scripts[1].gguf_path(checkpoint, type_name)), tokenizer=str(checkpoint), dtype="float32",
                  quantization="gguf", device="cpu", num_kv_blocks=16, max_batch_size=2, num_threads=1)  # fmt: skip
        params = SamplingParams(max_tokens=TOKENS, temperature=0.0, ignore_eos=True)
        got = [out.token_ids for out in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
        model = llm.engine.runner.model
        # the untied output matrix runs from the file's codes: no float copy of it was laid out
        assert not model.config.tie_word_embeddings and isinstance(model.output_proj, quantization.QuantizedLinear)
        assert (model.config.vocab_size, model.config.hidden_size) not in laid_out
    finally:
        quantization.quant_gemm_path.cache_clear()
    reference = quantized_transformers(checkpoint, type_name)
    assert got == [hf_greedy(reference, prompt, TOKENS) for prompt in PROMPTS]


def test_llama_cpp_computes_transformers_logits_from_the_file(scripts, checkpoint):
    llama_cpp = pytest.importorskip("llama_cpp")
    ids = PROMPTS[0] + PROMPTS[1]
    with torch.no_grad():
        want = quantized_transformers(checkpoint, "Q8_0")(torch.tensor([ids])).logits[0].numpy()
    llm = llama_cpp.Llama(model_path=str(scripts[1].gguf_path(checkpoint, "Q8_0")), n_ctx=64, logits_all=True,
                          n_threads=1, verbose=False)  # fmt: skip
    llm.eval(ids)
    got = np.asarray(llm.scores[: len(ids)])
    # llama.cpp rounds activations to 8 bits and K/V to float16: a few % of the logits' scale (q/k rows in HF's order
    # put it past the scale itself)
    assert np.abs(got - want).max() < 0.1 * np.abs(want).max()


@pytest.mark.parametrize("type_name", ["Q8_0", "Q4_1"])
def test_batchserves_dequantization_in_chunks_of_rows_equals_ggufs(scripts, checkpoint, monkeypatch, type_name):
    """models/gguf_weights.dequantize widens a big tensor (an 8B embedding table) a chunk of rows at a time, and
    dequantize_as converts each chunk to the model's dtype as it goes (no float32 copy of the whole)."""
    from batchserve.models import gguf_weights

    monkeypatch.setattr(gguf_weights, "DEQUANTIZE_CHUNK_BYTES", 1000)  # rows of 68 / 80 bytes: uneven chunks
    for tensor in gguf.GGUFReader(scripts[1].gguf_path(checkpoint, type_name)).tensors:
        want = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(gguf_weights.torch_shape(tensor))
        np.testing.assert_array_equal(gguf_weights.dequantize(tensor), want, err_msg=tensor.name)
        as_bf16 = gguf_weights.dequantize_as(tensor, torch.bfloat16)
        assert as_bf16.dtype == torch.bfloat16 and torch.equal(as_bf16, torch.tensor(want).bfloat16()), tensor.name
