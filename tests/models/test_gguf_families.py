"""GGUF files in llama.cpp's layout (convert_hf_to_gguf.py) for Gemma 2, Gemma 3 text, Mixtral (written as `llama`
with stacked expert tensors) and Qwen3-MoE (`qwen3moe`), written by the gguf package from tiny random transformers
models: each loads and gives transformers' greedy float32 tokens (F16: transformers on the same float16-rounded
matrices), and its conversion folder is a checkpoint transformers loads back to the same tokens."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
import transformers

from batchserve import env
from tests.models.conftest import MiniScheduler, load_ours, make_runner
from tests.models.test_architectures import add_common_metadata, llama_cpp_permute, rounded_through_float16
from tests.models.test_gemma import widened_window_greedy
from tests.models.test_llama import prompt_ids
from tests.tiny_models import COMMON, WINDOWED_KINDS, hf_greedy

# HF module -> llama.cpp tensor (gguf-py's tensor_mapping.py); Gemma's ffn_norm is its pre-feedforward norm
LAYER_NAMES = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down", "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm",
}  # fmt: skip
GLOBAL_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                "lm_head.weight": "output.weight"}  # fmt: skip


def gemma_variant(kind: str, **overrides) -> torch.nn.Module:
    """A tiny Gemma as test_gemma's `kind`, with what llama.cpp's GGUF cannot say set to what llama.cpp assumes
    (query_pre_attn_scalar = head_dim; Gemma 3: one global layer in 6, local RoPE base 10000), weights random."""
    base = WINDOWED_KINDS[kind]().to_dict()
    config = type(WINDOWED_KINDS[kind]()).from_dict({**base, "query_pre_attn_scalar": base["head_dim"], **overrides})
    torch.manual_seed(sum(map(ord, kind)) + 1)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(-0.5, 0.5)  # Gemma's norms scale by 1 + w
    model.generation_config.eos_token_id = None
    return model


def llama_cpp_tensor_name(hf_name: str) -> str:
    if hf_name in GLOBAL_NAMES:
        return GLOBAL_NAMES[hf_name]
    _, _, index, rest = hf_name.split(".", 3)
    module, kind = rest.rsplit(".", 1)
    return f"blk.{index}.{LAYER_NAMES[module]}.{kind}"


def finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_matrix(writer: gguf.GGUFWriter, name: str, data: np.ndarray, matrix_type: str) -> None:
    writer.add_tensor(name, data.astype(np.float16) if data.ndim >= 2 and matrix_type == "F16" else data)


def write_gemma_gguf(hf, arch: str, path, matrix_type: str) -> None:
    """convert_hf_to_gguf.py's Gemma2Model / Gemma3Model: soft-capping and window metadata, Gemma 3's global RoPE
    base and linear scaling, 1 added to every norm weight, no q/k permutation."""
    c = hf.config
    writer = gguf.GGUFWriter(str(path), arch)
    add_common_metadata(writer, c, c.head_dim)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
    else:
        rope = c.rope_parameters.get("full_attention", c.rope_parameters)
        writer.add_rope_freq_base(rope["rope_theta"])
        if rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope["factor"])
    if c.final_logit_softcapping:
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    writer.add_sliding_window(c.sliding_window)
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        data = tensor.numpy() + (np.float32(1.0) if name.endswith("norm.weight") else np.float32(0.0))
        add_matrix(writer, llama_cpp_tensor_name(name), data, matrix_type)
    finish(writer)


def generate_ours(path, prompts: dict[str, list[int]], max_new: int) -> dict[str, list[int]]:
    sched = MiniScheduler(make_runner(path, block_size=8, num_kv_blocks=64), chunk=16)
    for req_id, prompt in prompts.items():
        sched.add(req_id, prompt, max_new)
    return sched.run()


@pytest.mark.parametrize(
    "kind,arch,layers,matrix_type", [("gemma2", "gemma2", 4, "F32"), ("gemma3", "gemma3", 7, "F16")]
)
def test_gemma_gguf_gives_transformers_tokens(tmp_path, monkeypatch, kind, arch, layers, matrix_type):
    """Prompts past the window (8), beside another request; the norms stored as 1 + w are read as w once, the
    sliding/global layers are llama.cpp's (Gemma 2 alternates; Gemma 3: every 6th global), and the conversion folder
    loads in transformers to the same tokens."""
    monkeypatch.setattr(env, "cache_dir", lambda: tmp_path / "cache")
    overrides = {"num_hidden_layers": layers}
    if arch == "gemma3":
        rope = WINDOWED_KINDS[kind]().rope_parameters
        rope = {**rope, "sliding_attention": {**rope["sliding_attention"], "rope_theta": 10000.0}}
        overrides.update(sliding_window_pattern=6, layer_types=None, rope_parameters=rope)
    hf = gemma_variant(kind, **overrides)
    path = tmp_path / f"{kind}.gguf"
    write_gemma_gguf(hf, arch, path, matrix_type)
    config, _ = load_ours(path)
    assert config.architecture == ("gemma2" if arch == "gemma2" else "gemma3_text")
    assert list(config.extra["layer_types"]) == list(hf.config.layer_types)
    assert config.extra["query_pre_attn_scalar"] == hf.config.query_pre_attn_scalar
    assert config.extra["local_rope_theta"] == hf.config.rope_parameters.get("sliding_attention", {}).get(
        "rope_theta", config.rope_theta
    )
    reference = rounded_through_float16(hf) if matrix_type == "F16" else hf
    prompts = {"a": prompt_ids(31, 30), "b": prompt_ids(32, 5)}
    outputs = generate_ours(path, prompts, 8)
    assert outputs == {req_id: hf_greedy(reference, prompt, 8) for req_id, prompt in prompts.items()}
    assert outputs["a"] != widened_window_greedy(reference, prompts["a"], 8)  # the window mattered
    from batchserve.models.loader import ensure_gguf_cache

    folder = ensure_gguf_cache(path)
    converted = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    converted.generation_config.eos_token_id = None
    assert hf_greedy(converted.eval(), prompts["a"], 8) == outputs["a"]
    assert load_ours(folder)[0].extra == config.extra


# --- Mixtral (a `llama` GGUF with experts) and Qwen3-MoE ------------------------------------------------------------

MOE = dict(COMMON, num_local_experts=4, num_experts_per_tok=2)
MOE_CONFIGS = {
    "mixtral": lambda: transformers.MixtralConfig(**{**MOE, "intermediate_size": 48}, sliding_window=None),
    # every layer sparse and the top-k weights renormalised: what llama.cpp's qwen3moe runs
    "qwen3moe": lambda: transformers.Qwen3MoeConfig(
        **{**MOE, "num_local_experts": 6, "num_experts_per_tok": 3}, head_dim=24, moe_intermediate_size=40,
        norm_topk_prob=True, tie_word_embeddings=False,
    ),
}  # fmt: skip
MOE_LAYER_NAMES = {"post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp"}


def moe_model(arch: str) -> torch.nn.Module:
    torch.manual_seed(sum(map(ord, arch)))
    hf = transformers.AutoModelForCausalLM.from_config(MOE_CONFIGS[arch](), attn_implementation="eager").float().eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            elif name.endswith("gate.weight"):  # spread routing, so that renormalising the top-k matters
                param.normal_(0.0, 0.1)
    hf.generation_config.eos_token_id = None
    return hf


def moe_tensors(hf_name: str, tensor: torch.Tensor) -> list[tuple[str, np.ndarray]]:
    """llama.cpp's names; transformers' stacked experts (gate_up [E, 2I, H], down [E, H, I]) as ffn_*_exps."""
    if hf_name.endswith("mlp.experts.gate_up_proj"):
        prefix = llama_cpp_tensor_name(hf_name.replace("mlp.experts.gate_up_proj", "mlp.gate_proj.weight"))[
            : -len("ffn_gate.weight")
        ]
        gate, up = tensor.chunk(2, dim=1)
        return [(prefix + "ffn_gate_exps.weight", gate.numpy()), (prefix + "ffn_up_exps.weight", up.numpy())]
    if hf_name.endswith("mlp.experts.down_proj"):
        name = llama_cpp_tensor_name(hf_name.replace("mlp.experts.down_proj", "mlp.down_proj.weight"))
        return [(name.replace("ffn_down", "ffn_down_exps"), tensor.numpy())]
    module = hf_name.rsplit(".", 1)[0].split(".", 3)[-1] if hf_name.startswith("model.layers.") else None
    if module in MOE_LAYER_NAMES:
        return [(hf_name.split(".", 3)[2].join(("blk.", f".{MOE_LAYER_NAMES[module]}.weight")), tensor.numpy())]
    return [(llama_cpp_tensor_name(hf_name), tensor.numpy())]


def write_moe_gguf(hf, arch: str, path, matrix_type: str) -> None:
    """convert_hf_to_gguf.py's MixtralModel (LlamaModel: `llama`, q/k rows permuted) / Qwen3MoeModel: expert count,
    experts used, Qwen3-MoE's expert feed-forward length; each layer's experts stacked in ffn_{gate,up,down}_exps."""
    c = hf.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    writer = gguf.GGUFWriter(str(path), "llama" if arch == "mixtral" else arch)
    add_common_metadata(writer, c, head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(c.rope_parameters["rope_theta"])
    writer.add_expert_count(c.num_local_experts if arch == "mixtral" else c.num_experts)
    writer.add_expert_used_count(c.num_experts_per_tok)
    if arch == "qwen3moe":
        writer.add_expert_feed_forward_length(c.moe_intermediate_size)
    for hf_name, tensor in hf.state_dict().items():
        for name, data in moe_tensors(hf_name, tensor):
            if arch == "mixtral" and name.endswith(("attn_q.weight", "attn_k.weight")):
                heads = c.num_attention_heads if "attn_q" in name else c.num_key_value_heads
                data = llama_cpp_permute(data, heads)
            add_matrix(writer, name, data, matrix_type)
    finish(writer)


@pytest.mark.parametrize("arch,matrix_type", [("mixtral", "F32"), ("qwen3moe", "F16")])
def test_moe_gguf_gives_transformers_tokens(tmp_path, monkeypatch, arch, matrix_type):
    """A `llama` GGUF with experts builds the MoE model (Mixtral); the stacked expert tensors load into it, and the
    conversion folder (one tensor per expert, transformers' names) loads in transformers to the same tokens."""
    monkeypatch.setattr(env, "cache_dir", lambda: tmp_path / "cache")
    hf = moe_model(arch)
    path = tmp_path / f"{arch}.gguf"
    write_moe_gguf(hf, arch, path, matrix_type)
    config, model = load_ours(path)
    assert config.architecture == ("mixtral" if arch == "mixtral" else "qwen3_moe")
    assert (config.num_experts, config.num_experts_per_tok, config.norm_topk_prob) == (
        hf.config.num_local_experts if arch == "mixtral" else hf.config.num_experts, hf.config.num_experts_per_tok,
        True)  # fmt: skip
    reference = rounded_through_float16(hf) if matrix_type == "F16" else hf
    if matrix_type == "F16":  # the stacked experts are 3-D: rounded too
        with torch.no_grad():
            for param in reference.parameters():
                if param.dim() == 3:
                    param.copy_(param.half().float())
    prompts = {"a": prompt_ids(41, 20), "b": prompt_ids(42, 6)}
    outputs = generate_ours(path, prompts, 8)
    assert outputs == {req_id: hf_greedy(reference, prompt, 8) for req_id, prompt in prompts.items()}
    from batchserve.models.loader import ensure_gguf_cache

    folder = ensure_gguf_cache(path)
    converted = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    converted.generation_config.eos_token_id = None
    assert hf_greedy(converted.eval(), prompts["a"], 8) == outputs["a"]
    assert load_ours(folder)[0].num_experts == config.num_experts


@pytest.mark.parametrize(
    ("arch", "fields", "expected"),
    [
        ("gemma2", {}, "SFSFSF"),  # llama.cpp's defaults: period 2, window 4096
        ("gemma3", {"attention.sliding_window": 512}, "SSSSSF"),  # period 6
        ("gemma3", {}, "FFFFFF"),  # no window in the file: every layer global
        ("gemma3", {"attention.sliding_window": 512, "attention.sliding_window_pattern": 3}, "SSFSSF"),
        ("gemma3", {"attention.sliding_window": 512, "attention.sliding_window_pattern": 0}, "SSSSSS"),
        ("gemma2", {"attention.sliding_window_pattern": [True, False, False, True, True, False]}, "SFFSSF"),
    ],
)
def test_gemma_gguf_layer_pattern_follows_llama_cpp(arch, fields, expected):
    from batchserve.models.gemma import SLIDING
    from batchserve.models.gguf_config import _gemma_layer_types, _gemma_window

    def get(key, default=None):
        return fields.get(key, default)

    window = _gemma_window(get, arch)
    assert window == fields.get("attention.sliding_window", 4096 if arch == "gemma2" else None)
    types = _gemma_layer_types(get, arch, 6, window is not None)
    assert "".join("S" if t == SLIDING else "F" for t in types) == expected
