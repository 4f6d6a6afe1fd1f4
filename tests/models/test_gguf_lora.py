"""llama.cpp's GGUF LoRA files (models/gguf_lora.py) on a GGUF base: a file written by the gguf package from a PEFT
adapter as llama.cpp's converter lays it out (tensor names, q/k rows of B permuted for `llama`, alpha in the
metadata) reads back as the PEFT adapter's A, B and scale, and gives transformers + PEFT's greedy float32 tokens; a
GGUF file that is not a LoRA adapter is refused, naming the file."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from batchserve import LLM, LoRARequest, env
from batchserve.models.lora_adapters import LoRALoadError, load_peft_adapter
from batchserve.sampling_params import SamplingParams
from tests.models.conftest import load_ours
from tests.models.test_architectures import gguf_name, llama_cpp_permute, write_tiny_gguf
from tests.tiny_loras import ALL_SEVEN, make_adapter, peft_greedy
from tests.tiny_models import VOCAB, hf_greedy

RANK, ALPHA = 8, 16


def write_gguf_lora(peft_folder, hf_config, path) -> None:
    """The PEFT adapter in `peft_folder` as llama.cpp's convert_lora_to_gguf.py writes it for a `llama` base."""
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_string("general.type", "adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", float(ALPHA))
    for key, tensor in load_file(str(peft_folder / "adapter_model.safetensors")).items():
        module = key.removeprefix("base_model.model.").split(".lora_")[0]
        data = tensor.float().numpy()
        if key.endswith("lora_B.weight") and module.endswith(("q_proj", "k_proj")):
            heads = hf_config.num_attention_heads if module.endswith("q_proj") else hf_config.num_key_value_heads
            data = llama_cpp_permute(data, heads)
        part = "lora_a" if "lora_A" in key else "lora_b"
        writer.add_tensor(f"{gguf_name(module + '.weight')}.{part}", np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_pair(tiny_models, tmp_path_factory):
    """(transformers model, its GGUF base, the PEFT adapter, the same adapter as a GGUF LoRA file)."""
    hf, directory = tiny_models("llama")
    root = tmp_path_factory.mktemp("gguf_lora")
    base = root / "base.gguf"
    write_tiny_gguf(hf, "llama", base, "F32")
    adapter = make_adapter(directory, root / "peft", "gguf", seed=3, spec=(RANK, ALPHA, ALL_SEVEN, False))
    lora_file = root / "adapter.gguf"
    write_gguf_lora(adapter.folder, hf.config, lora_file)
    return hf, base, adapter, lora_file


@pytest.fixture
def cache_in_tmp(tmp_path, monkeypatch):
    monkeypatch.setattr(env, "cache_dir", lambda: tmp_path / "cache")  # the base's conversion folder stays here


def test_the_gguf_file_reads_back_as_the_peft_adapter(gguf_pair, cache_in_tmp):
    _, base, adapter, lora_file = gguf_pair
    config, _ = load_ours(base)
    ours = load_peft_adapter(lora_file, "g", 1, config, 16, torch.float32)
    peft = load_peft_adapter(adapter.folder, "p", 2, config, 16, torch.float32)
    assert (ours.rank, ours.scale) == (peft.rank, peft.scale) == (RANK, ALPHA / RANK)
    assert ours.weights.keys() == peft.weights.keys() and len(ours.targets) == 7
    for key, (a, b) in peft.weights.items():
        assert torch.equal(ours.weights[key][0], a) and torch.equal(ours.weights[key][1], b), key


def test_the_gguf_lora_gives_peft_tokens_on_the_gguf_base(gguf_pair, cache_in_tmp):
    hf, base, adapter, lora_file = gguf_pair
    llm = LLM(model=str(base), device="cpu", dtype="float32", enable_lora=True, max_loras=1, num_kv_blocks=64)
    prompts = [[(7 * i + 3) % (VOCAB - 3) + 3 for i in range(n)] for n in (5, 17)]
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=LoRARequest("g", 1, str(lora_file)))  # fmt: skip
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == peft_greedy(adapter, prompt, 8)
    assert [o.outputs[0].token_ids for o in outs] != [hf_greedy(hf, p, 8) for p in prompts]  # the adapter matters


def test_a_gguf_model_file_is_not_taken_for_an_adapter(gguf_pair, cache_in_tmp):
    _, base, _, _ = gguf_pair
    config, _ = load_ours(base)
    with pytest.raises(LoRALoadError, match=r"base.gguf: not a GGUF LoRA adapter \(general.type"):
        load_peft_adapter(base, "m", 1, config, 16, torch.float32)
