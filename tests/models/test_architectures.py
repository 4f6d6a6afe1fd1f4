"""Architectures against transformers: Qwen3 (q/k RMSNorm, explicit head_dim), Llama with YaRN and dynamic
NTK RoPE, Phi-3 (fused qkv / gate_up, LongRoPE) and Phi-4-mini's partial rotary. Tiny random models saved by
transformers go through our loader; greedy float32 tokens are transformers' own, with chunked prefills batched beside
other requests' decodes, and each test asserts that the native decoder loop ran the steps (where the kernels are
built: it runs every family's op plan)."""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import math

import gguf
import numpy as np
import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from batchserve import env
from batchserve.layers import kernels, rotary
from batchserve.layers.capabilities import Capability
from batchserve.models.gguf_config import llama3_scaling_from_factors
from batchserve.models.hf_config import common_fields, hf_rope
from tests.models.conftest import CountingLoop, MiniScheduler, load_ours, make_runner, staggered_outputs
from tests.models.test_gemma import widened_window_greedy
from tests.models.test_llama import our_prefill_logits, prompt_ids
from tests.tiny_models import ARCH_KINDS, VOCAB, build_hf_model, hf_greedy, text_after

NATIVE = kernels.load() is not None


def test_qwen3_config(tiny_models):
    config, model = load_ours(tiny_models("qwen3")[1])
    assert config.architecture == "qwen3" and config.qk_norm and config.head_dim == 24 != 64 // 4
    assert model.layers[0].self_attn.q_norm.weight.shape == (24,)
    assert Capability.QK_NORM in model.capabilities


def test_phi3_configs(tiny_models):
    config, _ = load_ours(tiny_models("phi3")[1])
    assert config.architecture == "phi3" and config.rotary_dim is None and config.sliding_window is None
    scaling = config.rope_scaling
    assert scaling["rope_type"] == "longrope" and scaling["original_max_position_embeddings"] == 32
    assert len(scaling["short_factor"]) == len(scaling["long_factor"]) == 8
    config, model = load_ours(tiny_models("phi4_mini")[1])
    assert config.rotary_dim == 12 and config.tie_word_embeddings
    assert Capability.PARTIAL_ROTARY in model.capabilities


def test_transformers_4_rope_spellings():
    """rope_scaling with "type" (Phi-3's "su" = longrope) and a top-level original_max_position_embeddings."""
    theta, scaling = hf_rope({"rope_theta": 1e4, "max_position_embeddings": 131072,
                              "original_max_position_embeddings": 4096,
                              "rope_scaling": {"type": "su", "short_factor": [1.0], "long_factor": [2.0]}})  # fmt: skip
    assert theta == 1e4
    assert scaling == {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [2.0],
                       "original_max_position_embeddings": 4096}  # fmt: skip
    _, scaling = hf_rope({"rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}})
    assert scaling == {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    assert hf_rope({"rope_theta": 5e5, "rope_scaling": {"rope_type": "default"}}) == (5e5, None)


def test_yarn_and_dynamic_ntk_serve_the_stretched_context(tiny_models):
    """Qwen3's YaRN recipe (factor 4 over 32,768, config.json's max_position_embeddings 40,960) serves 131,072 tokens,
    as vLLM does; dynamic NTK serves max_position_embeddings x factor and grows its base from the original length."""
    qwen3 = {"model_type": "qwen3", "vocab_size": 8, "hidden_size": 64, "intermediate_size": 8, "num_hidden_layers": 1,
             "num_attention_heads": 4, "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 1e6,
             "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}  # fmt: skip
    assert common_fields(qwen3).max_position_embeddings == 131072
    config, _ = load_ours(tiny_models("llama_dynamic")[1])
    assert config.max_position_embeddings == 48 and config.rope_scaling["original_max_position_embeddings"] == 24


@pytest.mark.parametrize("kind", ["llama_yarn", "llama_dynamic", "phi3", "phi4_mini"])
def test_rope_tables_match_transformers(tiny_models, kind):
    """cos/sin at every position, past the original context too, against transformers' rotary module run one
    position at a time (as generate decodes)."""
    hf, directory = tiny_models(kind)
    config, model = load_ours(directory)
    positions = torch.arange(0, 60)
    cos, sin = model.rotary(positions, torch.float32)
    ref = hf.model.rotary_emb
    for p in positions.tolist():
        ref_cos, ref_sin = ref(torch.zeros(1, 1, 8), torch.tensor([[p]]))
        half = ref_cos.shape[-1] // 2
        torch.testing.assert_close(cos[p], ref_cos[0, 0, :half], atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(sin[p], ref_sin[0, 0, :half], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("kind", list(ARCH_KINDS))
def test_logits_match_transformers(tiny_models, kind):
    hf, directory = tiny_models(kind)
    config, model = load_ours(directory)
    tokens = prompt_ids(1, 20)  # within every kind's original context: one frequency set in transformers too
    ours = our_prefill_logits(model, config, tokens)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,block_size,chunk", [("qwen3", 8, 5), ("llama_yarn", 16, 7), ("llama_dynamic", 8, 6),
                                                   ("phi3", 8, 9), ("phi4_mini", 16, 4), ("phi3_window", 8, 5)])  # fmt: skip
def test_greedy_generation_matches_transformers(tiny_models, caplog, kind, block_size, chunk):
    """Prompts shorter than the original context, generations past it (dynamic NTK grows its base there; YaRN scales
    cos/sin), prefilled in chunks beside another request's decodes, by the native decoder loop."""
    hf, directory = tiny_models(kind)
    with caplog.at_level(logging.INFO):
        runner = make_runner(directory, block_size=block_size, num_kv_blocks=64)
    model = runner.model
    counter = None
    if NATIVE:
        assert model.decoder_loop is not None
        counter = model.decoder_loop = CountingLoop(model.decoder_loop)
    prompts = {"a": prompt_ids(2, 19), "b": prompt_ids(3, 4), "c": prompt_ids(4, 13)}
    # LongRoPE: transformers recomputes a whole sequence with the long factors once it outgrows the original context
    # (Phi3ForCausalLM.prepare_inputs_for_generation); this engine keeps the keys it stored (docs/models.md)
    length = 32 if kind.startswith("phi") else 50
    max_new = {"a": min(20, length - 19), "b": min(30, length - 4), "c": 6}
    outputs = staggered_outputs(runner, chunk, prompts, max_new)
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == hf_greedy(hf, prompt, max_new[req_id]), req_id
    if counter is not None:
        assert counter.calls > 0, "the native decoder loop must have run the steps"
    if kind == "phi3_window":
        assert outputs["a"] != widened_window_greedy(hf, prompts["a"], max_new["a"]), "the window must change these"


@pytest.mark.parametrize("kind", ["qwen3", "phi3"])
def test_bfloat16_as_near_float32_as_transformers_bfloat16(tiny_models, kind):
    hf, directory = tiny_models(kind)
    config, model = load_ours(directory, dtype=torch.bfloat16)
    tokens = prompt_ids(5, 20)
    ours = our_prefill_logits(model, config, tokens, dtype=torch.bfloat16).float()
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
        theirs = (
            transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.bfloat16)(torch.tensor([tokens]))
            .logits[0]
            .float()
        )
    assert (ours - ref).abs().mean() <= 1.5 * (theirs - ref).abs().mean()


@pytest.mark.parametrize("rope_type", ["yarn", "dynamic", "longrope", "llama3"])
def test_inverse_frequencies_are_transformers(rope_type):
    """Our rope init against transformers' ROPE_INIT_FUNCTIONS for a full-size shape (head 128, base 5e5)."""
    scaling = {
        "yarn": {"factor": 4.0, "original_max_position_embeddings": 32768, "beta_fast": 32, "beta_slow": 1},
        "dynamic": {"factor": 2.0},
        "longrope": {"short_factor": [1.0 + i / 64 for i in range(64)], "long_factor": [1.0 + i / 8 for i in range(64)],
                     "original_max_position_embeddings": 4096},
        "llama3": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 8192},
    }[rope_type] | {"rope_type": rope_type}  # fmt: skip
    hf_config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                                         rope_theta=5e5, rope_scaling=dict(scaling))  # fmt: skip
    ours = common_fields({**hf_config.to_dict(), "vocab_size": 8, "intermediate_size": 8, "num_hidden_layers": 1})
    ref_inv_freq, ref_scale = ROPE_INIT_FUNCTIONS[rope_type](hf_config, torch.device("cpu"))
    assert torch.equal(rotary.rope_inv_freq(ours), ref_inv_freq)
    assert rotary.attention_scaling(ours) == pytest.approx(ref_scale, rel=1e-12)


# --- GGUF files written by the gguf package from the tiny models ---------------------------------------------------

GGUF_LAYER_NAMES = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "self_attn.qkv_proj": "attn_qkv", "mlp.gate_up_proj": "ffn_up",  # Phi-3's fused ones
}  # fmt: skip
GGUF_GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                     "lm_head.weight": "output.weight"}  # fmt: skip


def gguf_name(hf_name: str) -> str:
    if hf_name in GGUF_GLOBAL_NAMES:
        return GGUF_GLOBAL_NAMES[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{index}.{GGUF_LAYER_NAMES[module]}.{kind}"


def llama_cpp_permute(weights: np.ndarray, num_heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: llama.cpp's RoPE pairs adjacent dims."""
    return (
        weights.reshape(num_heads, 2, weights.shape[0] // num_heads // 2, *weights.shape[1:])
        .swapaxes(1, 2)
        .reshape(weights.shape)
    )


def llama3_rope_factors(hf_config) -> list[float]:
    """convert_hf_to_gguf.py's rope_freqs for llama3 scaling (one divisor per frequency)."""
    scaling = hf_config.rope_parameters
    dim = hf_config.hidden_size // hf_config.num_attention_heads
    freqs = 1.0 / (scaling["rope_theta"] ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    factor, low, high = scaling["factor"], scaling["low_freq_factor"], scaling["high_freq_factor"]
    old = scaling["original_max_position_embeddings"]
    factors = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < old / high:
            factors.append(1.0)
        elif wavelen > old / low:
            factors.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return factors


def add_common_metadata(writer: gguf.GGUFWriter, c, head_dim: int) -> None:
    """What convert_hf_to_gguf.py writes for every text model, and a byte-level BPE vocabulary of VOCAB tokens."""
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(VOCAB)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list([chr(33 + i) for i in range(VOCAB - 1)] + ['!"'])
    writer.add_token_types([1] * VOCAB)
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_merges(['! "'])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_tiny_gguf(hf, arch: str, path, matrix_type: str) -> None:
    """The model as llama.cpp's converter lays it out: metadata, a byte-level BPE vocabulary of VOCAB tokens, q/k
    rows permuted for llama, matrices in `matrix_type` (F32 or F16), norms in F32, rope_freqs for llama3 scaling,
    Phi-3's LongRoPE factors as tensors and its original context / attention factor as metadata."""
    c = hf.config
    rope = c.rope_parameters
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(path), arch)
    add_common_metadata(writer, c, head_dim)
    writer.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    writer.add_rope_freq_base(rope["rope_theta"])
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = tensor.numpy()
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in name else c.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        writer.add_tensor(gguf_name(name), data.astype(np.float16) if data.ndim == 2 and matrix_type == "F16" else data)
    if rope.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", np.array(llama3_rope_factors(c), dtype=np.float32))
    if rope.get("rope_type") == "longrope":  # convert_hf_to_gguf.py's Phi3MiniModel
        original = rope["original_max_position_embeddings"]
        writer.add_rope_scaling_orig_ctx_len(original)
        scale = c.max_position_embeddings / original
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
        writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], dtype=np.float32))
        writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], dtype=np.float32))
    if getattr(c, "sliding_window", None):
        writer.add_sliding_window(c.sliding_window)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def rounded_through_float16(hf):
    """transformers' model with its matrices rounded to float16 (what an F16 GGUF holds), computing in float32."""
    rounded = copy.deepcopy(hf)
    with torch.no_grad():
        for param in rounded.parameters():
            if param.dim() == 2:
                param.copy_(param.half().float())
    return rounded


@pytest.mark.parametrize("kind,arch,matrix_type", [("llama3_rope", "llama", "F32"), ("qwen3", "qwen3", "F16"),
                                                   ("phi3", "phi3", "F32"), ("phi4_mini", "phi3", "F16"),
                                                   ("phi3_window", "phi3", "F32")])  # fmt: skip
def test_gguf_from_the_gguf_package_gives_transformers_tokens(tiny_models, tmp_path, monkeypatch, kind, arch,
                                                              matrix_type):  # fmt: skip
    """A GGUF written by the gguf package loads (Llama 3's rope_freqs tensor as llama.cpp applies it; Qwen3's q/k norms
    and head_dim; Phi-3's fused tensors, LongRoPE factor tensors, partial rotary, window) and gives transformers' greedy
    tokens (F16: transformers on the same float16-rounded matrices)."""
    monkeypatch.setattr(env, "cache_dir", lambda: tmp_path / "cache")  # the conversion folder stays in tmp_path
    hf, _ = tiny_models(kind)
    path = tmp_path / f"{kind}.gguf"
    write_tiny_gguf(hf, arch, path, matrix_type)
    config, _ = load_ours(path)
    assert config.architecture == arch and config.head_dim == load_ours(tiny_models(kind)[1])[0].head_dim
    if kind == "llama3_rope":
        assert config.rope_scaling["rope_type"] == "freq_factors"
        hf_style = dataclasses.replace(config, rope_scaling=hf_rope(hf.config.to_dict())[1])
        torch.testing.assert_close(rotary.rope_inv_freq(config), rotary.rope_inv_freq(hf_style), rtol=1e-6, atol=0)
    reference = rounded_through_float16(hf) if matrix_type == "F16" else hf
    if arch == "phi3":
        ours_from_folder, _ = load_ours(tiny_models(kind)[1])
        for key in ("short_factor", "long_factor") if ours_from_folder.rope_scaling else ():
            assert config.rope_scaling[key] == pytest.approx(ours_from_folder.rope_scaling[key])
        assert (config.rope_scaling is None) == (ours_from_folder.rope_scaling is None)
        assert rotary.attention_scaling(config) == pytest.approx(rotary.attention_scaling(ours_from_folder))
        assert (config.rotary_dim, config.sliding_window) == (
            ours_from_folder.rotary_dim,
            ours_from_folder.sliding_window,
        )
    # past llama3_rope's original context (32); within LongRoPE's (as test_greedy_generation_matches_transformers)
    prompts = {"a": prompt_ids(21, 22 if arch == "phi3" else 40), "b": prompt_ids(22, 6)}
    sched = MiniScheduler(make_runner(path, block_size=8, num_kv_blocks=48), chunk=16)
    for req_id, prompt in prompts.items():
        sched.add(req_id, prompt, 10)
    outputs = sched.run()
    assert outputs == {req_id: hf_greedy(reference, prompt, 10) for req_id, prompt in prompts.items()}
    if arch == "phi3":  # the conversion folder is a Phi-3 checkpoint transformers loads (fused names, LongRoPE)
        from batchserve.models.loader import ensure_gguf_cache

        converted = transformers.AutoModelForCausalLM.from_pretrained(ensure_gguf_cache(path), dtype=torch.float32)
        assert hf_greedy(converted.eval(), prompts["a"], 10) == outputs["a"]


def test_llama31_rope_freqs_read_back_as_llama3_scaling_for_config_json():
    """The conversion folder's config.json: Llama 3.1's rope_freqs (head 128, base 5e5) become its llama3 parameters;
    factors that are no llama3 scaling give none."""
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}  # fmt: skip
    hf_config = transformers.LlamaConfig(hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
                                         rope_theta=5e5, rope_scaling=dict(scaling))  # fmt: skip
    assert llama3_scaling_from_factors(llama3_rope_factors(hf_config), 5e5, 128) == scaling
    assert llama3_scaling_from_factors([1.0] * 32 + [2.0] * 32, 5e5, 128) is None


# --- config.json round trip and chat templates ------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen3", "phi3", "phi4_mini", "phi3_window", "llama_yarn", "llama_dynamic"])
def test_our_config_json_reads_back_as_the_same_model(tiny_models, tmp_path, kind):
    """What a GGUF conversion folder's config.json says (models/gguf_config.hf_config_json) reads back the same."""
    from batchserve.models.gguf_config import hf_config_json
    from batchserve.models.hf_config import read_hf_config

    config = read_hf_config(tiny_models(kind)[1])
    (tmp_path / "config.json").write_text(json.dumps(hf_config_json(config)))
    assert read_hf_config(tmp_path) == config
    assert transformers.AutoConfig.from_pretrained(tmp_path).model_type == config.architecture


CHAT_TEMPLATE = ("{% for m in messages %}w3 {{ 'w7' if m['role'] == 'user' else 'w8' }} {{ m['content'] }} w4 "
                 "{% endfor %}{% if add_generation_prompt %}w5 w6{% endif %}")  # fmt: skip


def test_the_models_own_chat_template_through_chat_completions(tmp_path):
    """A Qwen3 folder's own chat template renders /v1/chat/completions' messages, and the reply is transformers'
    greedy continuation of exactly those tokens."""
    import httpx

    from batchserve.engine.llm_engine import LLMEngine
    from tests.models.test_hf_folder import save_tokenizer
    from tests.server.live import start_server

    hf = build_hf_model("qwen3", tmp_path)
    save_tokenizer(tmp_path)
    tokenizer_config = tmp_path / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps(json.loads(tokenizer_config.read_text()) | {"chat_template": CHAT_TEMPLATE}))
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    messages = [{"role": "user", "content": "w10 w11 w12"}, {"role": "assistant", "content": "w13"},
                {"role": "user", "content": "w14"}]  # fmt: skip
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert prompt == [3, 7, 10, 11, 12, 4, 3, 8, 13, 4, 3, 7, 14, 4, 5, 6]
    engine = LLMEngine.from_options(model=str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=32)
    server = start_server(engine)
    try:
        reply = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
            "model": server.model_id(), "messages": messages, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
        }).json()  # fmt: skip
    finally:
        server.stop()
    assert reply["usage"]["prompt_tokens"] == len(prompt)
    expected = text_after(tokenizer, prompt, hf_greedy(hf, prompt, 8))
    assert reply["choices"][0]["message"]["content"] == expected
