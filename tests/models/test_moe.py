"""Mixture of experts (layers/moe.py, models/moe.py): the grouped expert path against a per-token reference, and tiny
random Mixtral / Qwen3-MoE models saved by transformers against transformers' greedy tokens, prefilled in chunks beside
other requests' decodes, through the native decoder loop (its MOE_MLP op) and through the Python layers."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F
import transformers

from batchserve.layers import kernels
from batchserve.layers.capabilities import Capability
from batchserve.layers.moe import SparseMoE
from batchserve.models.registry import ModelLoadError
from tests.models.conftest import load_ours, make_runner, staggered_outputs
from tests.models.test_llama import our_prefill_logits, prompt_ids
from tests.tiny_models import COMMON, hf_greedy

MOE = dict(COMMON, num_local_experts=4, num_experts_per_tok=2)
MOE_KINDS = {
    "mixtral": lambda: transformers.MixtralConfig(**{**MOE, "intermediate_size": 48}, sliding_window=None),
    # a window of 8 under prompts of up to 19 tokens and generations past 30
    "mixtral_window": lambda: transformers.MixtralConfig(**{**MOE, "intermediate_size": 48}, sliding_window=8),
    # layer 1 of 3 dense (mlp_only_layers), the others routed to 2 of 4 experts, top-k weights left unnormalised
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **{**MOE, "num_hidden_layers": 3},
        head_dim=24,
        moe_intermediate_size=40,
        norm_topk_prob=False,
        mlp_only_layers=[1],
        tie_word_embeddings=False,
    ),
    "qwen3_moe_norm_topk": lambda: transformers.Qwen3MoeConfig(
        **{**MOE, "num_local_experts": 6, "num_experts_per_tok": 3},
        moe_intermediate_size=64,  # a multiple of 32: int8 takes it
        norm_topk_prob=True,
        decoder_sparse_step=2,
    ),
}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    """kind -> (hf model, saved directory), each built once: random weights, norms around 1, no early stop."""
    cache = {}

    def get(kind: str):
        if kind not in cache:
            torch.manual_seed(sum(map(ord, kind)))
            hf = transformers.AutoModelForCausalLM.from_config(MOE_KINDS[kind](), attn_implementation="eager")
            hf = hf.float().eval()
            with torch.no_grad():
                for name, param in hf.named_parameters():
                    if "norm" in name:
                        param.uniform_(0.5, 1.5)
                    elif name.endswith("gate.weight"):  # spread routing: the top-k weights sum well below 1
                        param.normal_(0.0, 0.1)  # (so that norm_topk_prob changes the greedy tokens)
            hf.generation_config.eos_token_id = None
            directory = tmp_path_factory.mktemp(kind)
            hf.save_pretrained(directory)
            cache[kind] = (hf, directory)
        return cache[kind]

    return get


# --- the MoE block -------------------------------------------------------------------------------------------------


def per_token_reference(block: SparseMoE, x: torch.Tensor, normalize: bool) -> torch.Tensor:
    """Each token on its own: softmax, top-k, (renormalise), sum of weight * expert(token), one expert at a time."""
    gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        probs = torch.softmax(x[t] @ block.gate.weight.t(), dim=-1)
        weights, experts = torch.topk(probs, block.gate.top_k)
        if normalize:
            weights = weights / weights.sum()
        for w, e in zip(weights.tolist(), experts.tolist(), strict=True):
            gate, up = (gate_up[e] @ x[t]).chunk(2)
            out[t] += w * (down[e] @ (F.silu(gate) * up))
    return out


def make_block(num_experts=8, top_k=2, normalize=True, hidden=32, inter=24, seed=0) -> SparseMoE:
    torch.manual_seed(seed)
    block = SparseMoE(hidden, inter, num_experts, top_k, normalize)
    with torch.no_grad():
        for param in block.parameters():
            param.normal_(0.0, 0.3)
    return block


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("cpu_layouts", [False, True])
def test_grouped_experts_match_per_token_reference(normalize, cpu_layouts):
    """Random routing over 8 experts, then tokens all routed to the same 2 experts (6 experts with no token): the
    grouped path gives the per-token sum within float32 rounding."""
    block = make_block(normalize=normalize)
    x = torch.randn(37, 32)
    skewed = x[:1].repeat(11, 1) + 1e-3 * torch.randn(11, 32)  # near-identical tokens: the same top-2 experts
    references = [per_token_reference(block, inputs, normalize) for inputs in (x, skewed)]
    if cpu_layouts:
        block.use_cpu_linear_layouts()
        assert block.experts.gate_up_proj is None and len(block.experts.cpu_layouts) == 8
    with torch.inference_mode():
        for inputs, ref in zip((x, skewed), references, strict=True):
            torch.testing.assert_close(block(inputs), ref, atol=1e-5, rtol=1e-5)
    _, experts = block.gate(skewed)
    assert len(set(experts.flatten().tolist())) == 2


def test_grouped_experts_run_one_gemm_per_active_expert():
    """A step of 64 tokens over 8 experts calls each active expert once, on all its tokens, and skips the others."""
    block = make_block(num_experts=8, top_k=2)
    calls: list[tuple[int, int]] = []
    expert = block.experts.expert

    def counting(index, tokens):
        calls.append((index, tokens.shape[0]))
        return expert(index, tokens)

    block.experts.expert = counting
    x = torch.randn(64, 32)
    with torch.inference_mode():
        block(x)
        _, routed = block.gate(x)
    counts = torch.bincount(routed.flatten(), minlength=8).tolist()
    assert calls == [(e, n) for e, n in enumerate(counts) if n]
    assert sum(n for _, n in calls) == 64 * 2


def test_bfloat16_block_near_float32():
    block = make_block()
    x = torch.randn(20, 32)
    with torch.inference_mode():
        ref = block(x)
        ours = block.to(torch.bfloat16)(x.bfloat16()).float()
    assert (ours - ref).abs().max() <= 0.05 * ref.abs().max()


# --- the models ------------------------------------------------------------------------------------------------------


def test_configs(moe_models):
    config, model = load_ours(moe_models("mixtral")[1])
    assert (config.architecture, config.num_experts, config.num_experts_per_tok) == ("mixtral", 4, 2)
    assert config.norm_topk_prob and config.dense_mlp_layers == [] and Capability.MOE in model.capabilities
    assert load_ours(moe_models("mixtral_window")[1])[0].sliding_window == 8
    config, model = load_ours(moe_models("qwen3_moe")[1])
    assert (config.architecture, config.moe_intermediate_size, config.norm_topk_prob) == ("qwen3_moe", 40, False)
    assert config.qk_norm and config.head_dim == 24 and config.dense_mlp_layers == [1]
    assert [isinstance(layer.mlp, SparseMoE) for layer in model.layers] == [True, False, True]
    config, _ = load_ours(moe_models("qwen3_moe_norm_topk")[1])
    assert config.norm_topk_prob and config.dense_mlp_layers == [0]  # decoder_sparse_step 2: layer 1 sparse


def copy_checkpoint(source, target, tensors) -> None:
    from safetensors.torch import save_file

    save_file(tensors, target / "model.safetensors", metadata={"format": "pt"})
    (target / "config.json").write_text((source / "config.json").read_text())


def test_missing_expert_is_refused(moe_models, tmp_path):
    """A checkpoint without one expert's up projection (Mixtral's w3) names it, instead of running on uninitialised
    memory."""
    from safetensors.torch import load_file

    directory = moe_models("mixtral")[1]
    tensors = load_file(directory / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    copy_checkpoint(directory, tmp_path, tensors)
    with pytest.raises(ValueError, match=r"layers\.1\.mlp\.experts\.gate_up_proj\[3\]\.up"):
        load_ours(tmp_path)


def test_stacked_experts_checkpoint_loads(moe_models, tmp_path):
    """transformers 5's in-memory layout (experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]) loads into the
    same weights as the per-expert tensors."""
    from safetensors.torch import load_file

    directory = moe_models("qwen3_moe")[1]
    tensors = load_file(directory / "model.safetensors")
    for layer in (0, 2):
        prefix = f"model.layers.{layer}.mlp.experts"
        per_expert = {p: [tensors.pop(f"{prefix}.{e}.{p}.weight") for e in range(4)]
                      for p in ("gate_proj", "up_proj", "down_proj")}  # fmt: skip
        tensors[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat(pair) for pair in zip(per_expert["gate_proj"], per_expert["up_proj"], strict=True)]
        )
        tensors[f"{prefix}.down_proj"] = torch.stack(per_expert["down_proj"])
    copy_checkpoint(directory, tmp_path, tensors)
    tokens = prompt_ids(7, 9)
    logits = [
        our_prefill_logits(model, config, tokens) for config, model in (load_ours(d) for d in (directory, tmp_path))
    ]
    torch.testing.assert_close(logits[0], logits[1], atol=0, rtol=0)


def test_unknown_moe_spelling_is_refused(moe_models, tmp_path):
    cfg = json.loads((moe_models("mixtral")[1] / "config.json").read_text())
    (tmp_path / "config.json").write_text(
        json.dumps({**cfg, "model_type": "dbrx", "architectures": ["DbrxForCausalLM"]})
    )
    with pytest.raises(ModelLoadError, match="mixtral.*qwen3_moe|qwen3_moe.*mixtral"):
        load_ours(tmp_path)


@pytest.mark.parametrize("kind", list(MOE_KINDS))
def test_logits_match_transformers(moe_models, kind):
    hf, directory = moe_models(kind)
    config, model = load_ours(directory)
    tokens = prompt_ids(1, 20)
    ours = our_prefill_logits(model, config, tokens)
    with torch.no_grad():
        ref = hf(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kind,block_size,chunk", [("mixtral", 8, 5), ("mixtral_window", 8, 5),
                                                   ("qwen3_moe", 16, 7), ("qwen3_moe_norm_topk", 8, 6)])  # fmt: skip
@pytest.mark.parametrize("native_loop", [True, False])
def test_greedy_generation_matches_transformers(moe_models, monkeypatch, kind, block_size, chunk, native_loop):
    """Chunked prefills beside another request's decodes, greedy float32 tokens identical to transformers', run by
    the native decoder loop or by the Python layers (their MoE blocks on batched tokens)."""
    hf, directory = moe_models(kind)
    if not native_loop:
        monkeypatch.setenv("BATCHSERVE_NATIVE_DECODER_LOOP", "0")
    runner = make_runner(directory, block_size=block_size, num_kv_blocks=64)
    model = runner.model
    loop_runs = native_loop and kernels.load() is not None
    assert (model.decoder_loop is not None) == loop_runs
    block_calls = []
    for layer in model.layers:
        if isinstance(layer.mlp, SparseMoE):
            layer.mlp.register_forward_hook(lambda module, args, out: block_calls.append(args[0].shape[0]))
    prompts = {"a": prompt_ids(2, 19), "b": prompt_ids(3, 4), "c": prompt_ids(4, 13)}
    max_new = {"a": 12, "b": 20, "c": 6}
    outputs = staggered_outputs(runner, chunk, prompts, max_new)
    for req_id, prompt in prompts.items():
        assert outputs[req_id] == hf_greedy(hf, prompt, max_new[req_id]), req_id
    if loop_runs:
        assert not block_calls, "the native loop ran every step"
    else:
        assert max(block_calls) > 1, "the MoE blocks ran on batched tokens"


def test_bfloat16_as_near_float32_as_transformers_bfloat16(moe_models):
    hf, directory = moe_models("qwen3_moe")
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


def test_experts_kept_quantized(moe_models):
    """--quantization int8 keeps each expert's projections quantized, as every decoder projection; logits stay near."""
    from batchserve.layers.quantization import QuantizedLinear, quantized_linears

    directory = moe_models("qwen3_moe_norm_topk")[1]
    config, model = load_ours(directory)
    with quantized_linears("int8"):
        _, quantized = load_ours(directory)
    sparse = quantized.layers[1].mlp
    assert isinstance(sparse, SparseMoE)
    assert all(isinstance(p, QuantizedLinear) for pair in sparse.experts.cpu_layouts for p in pair)
    tokens = prompt_ids(6, 16)
    ref, ours = our_prefill_logits(model, config, tokens), our_prefill_logits(quantized, config, tokens)
    assert (ours - ref).abs().max() <= 0.05 * ref.abs().max()


def test_no_cuda_graphs_for_moe(caplog):
    """Decode CUDA graphs skip a MoE model (its per-step split by expert is read on the host): a fallback row of the
    mode table, said in one log line and set as enforce_eager before anything touches a GPU."""
    from batchserve import modes
    from batchserve.config import EngineConfig, ModelConfig

    moe = ModelConfig(8, 8, 8, 1, 1, 1, 8, 16, num_experts=4, num_experts_per_tok=2)
    config = EngineConfig()
    facts = modes.ModeFacts.of(config, moe, "cuda", "bfloat16", native_kernels=False)
    with caplog.at_level(logging.WARNING, logger="batchserve.modes"):
        decision = modes.enforce(config, facts)
    assert decision.fallback_names == ["moe_without_cuda_graphs"] and config.enforce_eager
    assert any("mode fallback moe_without_cuda_graphs" in r.getMessage() for r in caplog.records)
