"""A PEFT adapter folder read against its base: the weights and scales as PEFT computes them, and every folder that
cannot be served refused with a clear error naming the module, shapes, rank or file; the engine keeps serving."""

from __future__ import annotations

import json
import math

import pytest
import torch

from batchserve.config import ConfigError
from batchserve.engine.llm_engine import LLMEngine
from batchserve.models.loader import load_model_config
from batchserve.models.lora_adapters import LoRALoadError, load_peft_adapter
from batchserve.request import LoRARequest
from tests.tiny_loras import ALL_SEVEN, make_adapter
from tests.tiny_models import tiny_checkpoint


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    _, directory = tiny_checkpoint(tmp_path_factory, "llama", "lora_base")
    return directory, load_model_config(directory)


@pytest.fixture(scope="module")
def adapter(base, tmp_path_factory):
    return make_adapter(base[0], tmp_path_factory.mktemp("a") / "poet", "poet", seed=1)


def load(folder, config, max_rank=64):
    return load_peft_adapter(folder, "x", 1, config, max_rank, torch.float32)


def test_weights_and_rslora_scale_as_peft_holds_them(base, adapter):
    loaded = load(adapter.folder, base[1])
    assert loaded.rank == 16 and loaded.scale == pytest.approx(8 / math.sqrt(16))  # rsLoRA: alpha / sqrt(r)
    assert loaded.targets == set(ALL_SEVEN) and len(loaded.weights) == 2 * 7
    peft_q = adapter.model.base_model.model.model.layers[1].self_attn.q_proj
    a, b = loaded.weights[(1, "q_proj")]
    assert torch.equal(a, peft_q.lora_A["default"].weight) and torch.equal(b, peft_q.lora_B["default"].weight)


def test_a_rank_over_max_lora_rank_is_refused(base, adapter):
    with pytest.raises(LoRALoadError, match="rank 16 is over max_lora_rank 8"):
        load(adapter.folder, base[1], max_rank=8)


def test_shapes_that_do_not_fit_the_base_name_the_module(base, tmp_path_factory):
    _, other = tiny_checkpoint(tmp_path_factory, "llama_head64", "other_base")  # hidden size 128, not 64
    folder = tmp_path_factory.mktemp("b") / "wide"
    make_adapter(other, folder, "wide", seed=2, spec=(4, 8, ["q_proj"], False))
    with pytest.raises(LoRALoadError, match=r"layers\.0\.q_proj has A \(4, 128\).*weight is \(64, 64\)"):
        load(folder, base[1])


def test_a_corrupt_safetensors_file_is_a_clear_error(base, adapter, tmp_path):
    folder = tmp_path / "corrupt"
    folder.mkdir()
    (folder / "adapter_config.json").write_text((adapter.folder / "adapter_config.json").read_text())
    data = (adapter.folder / "adapter_model.safetensors").read_bytes()
    (folder / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(LoRALoadError, match="adapter_model.safetensors: not a readable safetensors file"):
        load(folder, base[1])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"use_dora": True}, "use_dora not served"),
        ({"r": 0}, "r must be a positive number"),
        ({"peft_type": "IA3"}, "peft_type 'IA3' is not served"),
    ],
)
def test_configs_not_served_are_refused(base, adapter, tmp_path, change, message):
    folder = tmp_path / "changed"
    folder.mkdir()
    config = json.loads((adapter.folder / "adapter_config.json").read_text()) | change
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes((adapter.folder / "adapter_model.safetensors").read_bytes())
    with pytest.raises(LoRALoadError, match=message):
        load(folder, base[1])


def test_the_engine_refuses_a_bad_adapter_and_keeps_serving(base, adapter, tmp_path):
    engine = LLMEngine.from_options(
        model=str(base[0]), device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8, num_kv_blocks=64
    )
    with pytest.raises(LoRALoadError, match="over max_lora_rank"):
        engine.add_lora(LoRARequest("poet", 1, str(adapter.folder)))
    with pytest.raises(LoRALoadError, match="is not a folder"):
        engine.add_lora(LoRARequest("missing", 2, str(tmp_path / "nowhere")))
    assert engine.list_loras() == [] and not engine.runner.lora.known
    engine.add_prompt("after", {"prompt_token_ids": [5, 6, 7]})
    while engine.has_unfinished_requests():
        engine.step()
    with pytest.raises(ConfigError, match="over max_lora_rank"):  # at start: the server does not come up
        LLMEngine.from_options(
            model=str(base[0]), device="cpu", dtype="float32", enable_lora=True, max_lora_rank=8,
            lora_modules=f"poet={adapter.folder}", num_kv_blocks=64,
        )  # fmt: skip
