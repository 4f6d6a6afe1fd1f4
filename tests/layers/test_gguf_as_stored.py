"""quantization gguf: a GGUF file's quantized tensors run as stored. Each type's repack equals gguf's own
dequantization; the quantized GEMM's per-group minimum and group-16 scales on every path equal a float64 reference
within float32 accumulation's bound; a tiny random Llama written by the gguf package serves through the native
decoder loop and gives exactly the greedy tokens of the float32 model whose weights are gguf's dequantized ones; what
cannot run as stored is refused by name."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers
from gguf.quants import dequantize as reference_dequantize
from gguf.quants import quantize

from batchserve import LLM, SamplingParams, env
from batchserve.config import ConfigError
from batchserve.layers import gguf_codes, kernels, quantization
from batchserve.layers.quantization import QuantizedLinear
from tests.models.test_architectures import write_tiny_gguf
from tests.tiny_models import COMMON, build_hf_model

QUANTIZABLE = ("Q8_0", "Q4_0", "Q4_1", "Q5_0")  # gguf-py quantizes these; K-quant blocks are built by hand
EPS = float(np.finfo(np.float32).eps)


@pytest.fixture(autouse=True)
def weight_only_kernels(monkeypatch):
    """Tokens and products here must equal the dequantized weight's exactly: the weight-only kernel path (W8A8 also
    rounds the activations; test_every_kernel_path_with_minimums_and_small_groups bounds it directly)."""
    if quantization.quant_gemm_path_runs("avx512"):
        monkeypatch.setenv("BATCHSERVE_QUANT_GEMM_PATH", "avx512")
    quantization.quant_gemm_path.cache_clear()
    yield
    quantization.quant_gemm_path.cache_clear()


def qtype(name: str) -> gguf.GGMLQuantizationType:
    return gguf.GGMLQuantizationType[name]


def random_k_blocks(type_name: str, rows: int, cols: int, seed: int = 1) -> np.ndarray:
    """Raw K-quant blocks [rows, bytes]: random quants and 6-bit sub-scales, small finite float16 d. Q4_K/Q5_K: each
    sub-block's min code equals its scale code and dmin is d times the middle code, so values centre on 0 (random
    mins would give every row one sign and a model with one answer)."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype(type_name)]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    d = rng.uniform(2e-3, 1e-2, size=(blocks.shape[0], 1)).astype(np.float16)
    if type_name == "Q6_K":  # d: the block's last 2 bytes
        blocks[:, -2:] = d.view(np.uint8)
    else:  # d, dmin: its first 4 bytes, then 12 bytes of 6-bit scale and min codes
        middle = 7.5 if type_name == "Q4_K" else 15.5
        blocks[:, :4] = np.concatenate([d, (d.astype(np.float32) * middle).astype(np.float16)], axis=1).view(np.uint8)
        blocks[:, 8:12] = blocks[:, 4:8]
        blocks[:, 12:16] = (blocks[:, 12:16] & 15) * np.uint8(17)
    return blocks.reshape(rows, cols // block_size * type_size)


def gguf_blocks(type_name: str, weights: np.ndarray, seed: int = 1) -> np.ndarray:
    if type_name in QUANTIZABLE:
        return quantize(weights.astype(np.float32), qtype(type_name))
    return random_k_blocks(type_name, *weights.shape, seed=seed)


def reference(blocks: np.ndarray, type_name: str, shape) -> torch.Tensor:
    return torch.from_numpy(reference_dequantize(blocks, qtype(type_name)).reshape(shape).astype(np.float32))


@pytest.mark.parametrize("type_name", gguf_codes.TYPES_AS_STORED)
def test_each_repack_equals_ggufs_dequantization(type_name):
    weights = np.random.default_rng(0).standard_normal((6, 512)).astype(np.float32)
    blocks = gguf_blocks(type_name, weights)
    stored = gguf_codes.repack(blocks, type_name)
    got, want = gguf_codes.dequantize(stored), reference(blocks, type_name, weights.shape)
    if stored.mins is None or stored.scheme.bits == 8:  # Q8_0, Q4_0, Q5_K, Q6_K: the same products bit for bit
        assert torch.equal(got, want)
    else:  # Q4_1, Q4_K: the minimum carries 8 scales (the kernels' nibble - 8): one float32 rounding of it apart
        mins = stored.mins.repeat_interleave(stored.scheme.group, dim=1)
        assert ((got - want).abs() <= EPS * (mins.abs() + want.abs())).all()


def test_a_type_that_cannot_run_as_stored_is_refused_by_name():
    blocks = quantize(np.zeros((2, 64), dtype=np.float32), qtype("Q5_0"))
    with pytest.raises(ConfigError, match=r"type Q5_0, which cannot be run as stored; Q8_0, Q4_0, Q4_1, Q4_K"):
        gguf_codes.repack(blocks, "Q5_0")


def test_mixed_parts_concatenate_exactly():
    """q in Q4_1, k in Q6_K, v in Q8_0 stacked into one layout all take (int8, group 16, minimums): the rows'
    values are each part's own."""
    weights = np.random.default_rng(2).standard_normal((4, 256)).astype(np.float32)
    parts = [gguf_codes.repack(gguf_blocks(t, weights), t) for t in ("Q4_1", "Q6_K", "Q8_0")]
    fused = gguf_codes.concatenate(parts)
    assert (fused.scheme.bits, fused.scheme.group, fused.mins is not None) == (8, 16, True)
    torch.testing.assert_close(
        gguf_codes.dequantize(fused), torch.cat([gguf_codes.dequantize(p) for p in parts]), rtol=0, atol=1e-6
    )


@pytest.mark.parametrize("type_name", ["Q4_1", "Q4_K", "Q5_K", "Q6_K"])
def test_every_kernel_path_with_minimums_and_small_groups(type_name):
    """Each path built and runnable here (forced by name), at decode and prefill row counts, against the float64
    product of gguf's dequantized weight: within float32 accumulation's bound."""
    native = kernels.load()
    if native is None:
        pytest.skip("native kernels not built")
    n, k = 40, 512
    blocks = gguf_blocks(type_name, np.random.default_rng(3).standard_normal((n, k)).astype(np.float32))
    stored = gguf_codes.repack(blocks, type_name)
    weight = reference(blocks, type_name, (n, k)).double()
    torch.testing.assert_close(
        native.quant_dequantize(stored.codes, stored.scales, stored.scheme.bits, stored.scheme.group, stored.mins),
        weight.float(), rtol=0, atol=4 * EPS * weight.abs().max().item(),
    )  # fmt: skip
    block = QuantizedLinear.ACT_BLOCK
    for path in native.quant_gemm_paths():
        for m in (1, 3, 7, 80):
            x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
            out = native.quant_gemm(x, stored.codes, stored.scales, stored.scheme.bits, stored.scheme.group, path, 64,
                                    stored.mins, act_block=block)  # fmt: skip
            exact = x.double() @ weight.T
            bound = 2 * k * EPS * (x.double().abs() @ weight.abs().T) + 1e-6
            packed = stored.scheme.group % 32 == 0  # W8A8 packs whole 32-k subblocks; Q6_K's groups of 16 are not
            if path == quantization.W8A8_PATH and packed:  # activations rounded to half an int8 step of their block
                steps = x.reshape(m, k // block, block).abs().amax(-1, keepdim=True).expand(-1, -1, block) / 127.0
                bound = bound + 0.5 * (1 + 1e-5) * (steps.reshape(m, k).double() @ weight.abs().T)
            assert ((out.double() - exact).abs() <= bound).all(), (path, m)


# ---- served end to end ---------------------------------------------------------------------------------------------

PROMPTS = [{"prompt_token_ids": [5, 17, 33, 8, 61]}, {"prompt_token_ids": [40, 41, 3]}, {"prompt_token_ids": [9] * 20}]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def tiny_llama(directory, width: int):
    """A tiny random Llama, tied embeddings (as SmolLM2), dimensions K-quants take when width is 256."""
    torch.manual_seed(width)
    config = transformers.LlamaConfig(
        **{**COMMON, "hidden_size": width, "intermediate_size": 2 * width},
        tie_word_embeddings=True,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    return model


def write_quantized_gguf(hf, path, type_name: str, monkeypatch, embedding_type: str = "Q8_0") -> None:
    """write_tiny_gguf with every 2-D matrix in `type_name` (the embedding, tied as the output, in embedding_type, as
    in SmolLM2's Q4_1 file), norms in F32."""
    add_tensor = gguf.GGUFWriter.add_tensor

    def quantized(self, name, data, *args, raw_dtype=None, **kwargs):
        if data.ndim != 2:
            return add_tensor(self, name, data, *args, raw_dtype=raw_dtype, **kwargs)
        kind = embedding_type if name == "token_embd.weight" else type_name
        return add_tensor(self, name, gguf_blocks(kind, data, seed=len(name)), raw_dtype=qtype(kind))

    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_tensor", quantized)
        write_tiny_gguf(hf, "llama", path, "F32")


def greedy(path, **options):
    llm = LLM(model=str(path), dtype="float32", device="cpu", num_kv_blocks=16, max_batch_size=4, **options)
    return llm, [out.token_ids for out in llm.generate(PROMPTS, PARAMS)]


@pytest.mark.parametrize(
    "type_name,width", [("Q4_1", 64), ("Q4_0", 64), ("Q8_0", 64), ("Q4_K", 256), ("Q5_K", 256), ("Q6_K", 256)]
)
def test_a_gguf_serves_its_own_codes_with_the_dequantized_models_tokens(tmp_path, monkeypatch, type_name, width):
    monkeypatch.setattr(env, "cache_dir", lambda: tmp_path / "cache")
    monkeypatch.setenv("BATCHSERVE_NATIVE_DECODER_LOOP", "1")
    path = tmp_path / f"tiny-{type_name}.gguf"
    write_quantized_gguf(tiny_llama(tmp_path / "hf", width), path, type_name, monkeypatch)
    called, forward = set(), QuantizedLinear.forward
    monkeypatch.setattr(QuantizedLinear, "forward", lambda self, x: called.add(id(self)) or forward(self, x))
    llm, tokens = greedy(path, quantization="gguf")
    model = llm.engine.runner.model
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 2 * 4 + 1 and model.output_proj.scheme.bits == 8  # + the logits from token_embd's Q8_0
    # the step is one native call: no decoder projection was called from Python, the logits' projection was
    assert model.decoder_loop is not None and called == {id(model.output_proj)}
    _, dequantized = greedy(path)  # quantization none: the file dequantized by gguf.quants to float32
    assert tokens == dequantized and all(len(ids) == PARAMS.max_tokens for ids in tokens)


def test_the_python_layers_serve_the_same_codes(tmp_path, monkeypatch):
    """Off the native loop (the Python layers over the native GEMM): the dequantized model's tokens too."""
    monkeypatch.setattr(env, "cache_dir", lambda: tmp_path / "cache")
    path = tmp_path / "tiny-Q4_1.gguf"
    write_quantized_gguf(tiny_llama(tmp_path / "hf", 64), path, "Q4_1", monkeypatch)
    _, dequantized = greedy(path)
    monkeypatch.setenv("BATCHSERVE_NATIVE_DECODER_LOOP", "0")
    llm, tokens = greedy(path, quantization="gguf")
    assert llm.engine.runner.model.decoder_loop is None and tokens == dequantized


@pytest.mark.parametrize("type_name", ["Q4_1", "Q6_K"])
def test_the_torch_code_applies_the_minimums(type_name):
    """A layer from the codes without the native kernels (the torch code on the weight dequantized with its minimums)
    and with them give x @ gguf's dequantized weight; float_output keeps float32 for bf16 rows (the logits)."""
    blocks = gguf_blocks(type_name, np.random.default_rng(4).standard_normal((24, 256)).astype(np.float32))
    stored = gguf_codes.repack(blocks, type_name)
    layer = QuantizedLinear.from_codes(stored.codes, stored.scales, stored.scheme, mins=stored.mins, float_output=True)
    x = torch.randn(5, 256)
    exact = x.double() @ reference(blocks, type_name, (24, 256)).double().T
    torch.testing.assert_close(layer._torch_forward(x).double(), exact, rtol=1e-5, atol=1e-5)
    if layer.native is not None:
        torch.testing.assert_close(layer(x).double(), exact, rtol=1e-5, atol=1e-5)
        assert layer(x.bfloat16()).dtype == torch.float32


def test_gguf_refuses_a_hugging_face_folder_and_an_unsupported_type(tmp_path, monkeypatch):
    monkeypatch.setattr(env, "cache_dir", lambda: tmp_path / "cache")
    folder = tmp_path / "hf"
    build_hf_model("llama", folder)
    with pytest.raises(ConfigError, match="quantization gguf runs a GGUF file's own quantized tensors"):
        LLM(model=str(folder), dtype="float32", device="cpu", quantization="gguf", num_kv_blocks=16)
    path = tmp_path / "tiny-Q5_0.gguf"
    write_quantized_gguf(tiny_llama(tmp_path / "hf2", 64), path, "Q5_0", monkeypatch)
    with pytest.raises(ConfigError, match=r"'blk.0.attn_q.weight' has type Q5_0, which cannot be run as stored"):
        LLM(model=str(path), dtype="float32", device="cpu", quantization="gguf", num_kv_blocks=16)
