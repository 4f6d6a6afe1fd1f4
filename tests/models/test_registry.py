"""The model registry (models/registry.py): lookups by model_type, HF class name and GGUF architecture; an unknown
architecture refused at load with the list of supported ones, before any part of a model is built."""

from __future__ import annotations

import json

import gguf
import pytest

from batchserve.models import loader, registry
from batchserve.models.registry import ModelLoadError

FAMILIES = {"llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3_text"}


def test_every_family_is_registered_and_its_class_imports():
    specs = {spec.model_type: spec for spec in registry.supported()}
    assert FAMILIES <= set(specs)
    for spec in specs.values():
        cls = registry.model_class(spec)
        assert hasattr(cls, "load_weights") and hasattr(cls, "compute_logits"), spec.model_type
        assert spec.exact, f"{spec.model_type}: the docs table needs its exact/approximated line"


def test_lookup_by_class_name_and_gguf_name():
    assert registry.lookup(hf_class_names=["Qwen3ForCausalLM"]).model_type == "qwen3"
    assert registry.lookup(model_type="unknown", hf_class_names=["Phi3ForCausalLM"]).model_type == "phi3"
    assert registry.lookup(gguf_name="qwen3").model_type == "qwen3"
    assert registry.lookup(gguf_name="llama").model_type == "llama"


def test_unknown_hf_architecture_is_refused_with_the_list(tmp_path, monkeypatch):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    built = []
    monkeypatch.setattr(registry, "model_class", lambda spec: built.append(spec))
    with pytest.raises(ModelLoadError) as refused:
        config = loader.load_model_config(tmp_path)
        loader.load_model(tmp_path, config, None, None)
    message = str(refused.value)
    assert "'gpt2'" in message and "GPT2LMHeadModel" in message
    for family in FAMILIES:
        assert family in message
    assert not built, "no model class may be reached for an unknown architecture"


def test_unknown_gguf_architecture_is_refused_with_the_list(tmp_path):
    path = tmp_path / "m.gguf"
    writer = gguf.GGUFWriter(str(path), "falcon")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ModelLoadError, match=r"GGUF architecture 'falcon' is not supported.*qwen3"):
        loader.load_model_config(path)


def test_a_missing_family_module_is_skipped_but_a_broken_one_fails(tmp_path, monkeypatch):
    (tmp_path / "broken_family.py").write_text("import a_module_that_is_not_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_FAMILY_MODULES", ("batchserve.models.llama", "batchserve.models.not_written_yet"))
    assert registry.lookup(model_type="qwen3").model_type == "qwen3"
    monkeypatch.setattr(registry, "_loaded", False)
    monkeypatch.setattr(registry, "_FAMILY_MODULES", ("broken_family",))
    with pytest.raises(ModuleNotFoundError, match="a_module_that_is_not_installed"):
        registry.supported()


def test_the_docs_table_lists_every_registered_architecture():
    from pathlib import Path

    page = (Path(__file__).parents[2] / "docs" / "models.md").read_text()
    for spec in registry.supported():
        assert f"`{spec.model_type}`" in page, spec.model_type
        for name in spec.gguf_names:
            assert f"`{name}`" in page, name
