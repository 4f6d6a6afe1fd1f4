"""The GGUF conversion folder is a complete Hugging Face folder: config.json, generation_config.json and
tokenizer files that transformers' AutoConfig / AutoTokenizer load, and the start-up log names it."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
from transformers import AutoConfig, AutoTokenizer, GenerationConfig

from batchserve.models.loader import (
    _complete_hf_folder,
    _hf_config,
    _named_class_config,
    ensure_gguf_cache,
    hf_config_json,
    load_model_config,
    load_tokenizer,
    resolve_model_path,
)
from tests.tiny_models import build_hf_model, save_word_tokenizer


def save_tokenizer(directory):
    save_word_tokenizer(directory)


@pytest.mark.parametrize("kind", ["llama", "llama_tied", "llama3_rope", "llama_attn_bias_mha", "qwen2"])
def test_our_config_json_reads_back_as_the_same_model(tmp_path, kind):
    source, copy = tmp_path / "source", tmp_path / "copy"
    build_hf_model(kind, source)
    config = _hf_config(source)
    copy.mkdir()
    (copy / "config.json").write_text(json.dumps(hf_config_json(config)))
    assert _hf_config(copy) == config
    hf = AutoConfig.from_pretrained(copy)
    assert (hf.num_hidden_layers, hf.num_key_value_heads, hf.tie_word_embeddings) == (
        config.num_layers, config.num_kv_heads, config.tie_word_embeddings,
    )  # fmt: skip


def test_a_folder_converted_before_is_completed(tmp_path):
    build_hf_model("llama", tmp_path / "source")
    config = dataclasses.replace(_hf_config(tmp_path / "source"), eos_token_ids=[2, 5])
    folder = tmp_path / "old-cache"
    save_tokenizer(folder)
    (folder / "model_config.json").write_text(json.dumps(dataclasses.asdict(config)))
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(
        json.dumps(tokenizer_config | {"tokenizer_class": "TokenizersBackend"})
    )
    _complete_hf_folder(folder)
    assert _hf_config(folder) == config
    assert GenerationConfig.from_pretrained(folder).eos_token_id == [2, 5]
    assert json.loads((folder / "tokenizer_config.json").read_text())["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert AutoTokenizer.from_pretrained(folder).encode("w3 w4", add_special_tokens=False) == [3, 4]


def test_the_start_up_log_and_effective_config_name_the_tokenizer_folder(tmp_path, caplog):
    from batchserve.engine.llm_engine import LLMEngine

    build_hf_model("llama", tmp_path)
    save_tokenizer(tmp_path)
    with caplog.at_level(logging.INFO):
        engine = LLMEngine.from_options(model=str(tmp_path), device="cpu", dtype="float32", num_kv_blocks=8)
    assert f"tokenizer from {tmp_path}" in caplog.text
    assert engine.effective_config()["tokenizer"] == str(tmp_path)
    assert "tokenizer=None" not in caplog.text


@pytest.mark.slow
def test_the_default_models_conversion_folder_loads_in_transformers():
    try:
        path = resolve_model_path(None)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"default model not installed: {exc}")
    folder = ensure_gguf_cache(path)
    assert _hf_config(folder) == load_model_config(path)
    assert AutoConfig.from_pretrained(folder).model_type == "llama"
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert tokenizer.chat_template and tokenizer.eos_token == "<|im_end|>"
    assert GenerationConfig.from_pretrained(folder).eos_token_id == load_model_config(path).eos_token_ids


def test_a_reinstalled_file_keeps_its_conversion_and_another_file_gets_its_own(tmp_path, monkeypatch):
    """The folder is keyed by what the file holds: each install of the same package (a new venv, a reinstall) gives
    the file a new mtime, and keyed by it every install converted again and left another 0.5 GB folder behind."""
    import os

    from batchserve import env
    from batchserve.models.loader import FINGERPRINT_BYTES, gguf_cache_dir

    monkeypatch.setattr(env, "cache_dir", lambda: tmp_path / "cache")
    body = os.urandom(3 * FINGERPRINT_BYTES)
    first, reinstalled, other = tmp_path / "a" / "m.gguf", tmp_path / "b" / "m.gguf", tmp_path / "c" / "m.gguf"
    for path, data in ((first, body), (reinstalled, body), (other, body[:-1] + bytes([body[-1] ^ 1]))):
        path.parent.mkdir()
        path.write_bytes(data)
    os.utime(reinstalled, ns=(1, 1))
    assert gguf_cache_dir(first) == gguf_cache_dir(reinstalled)
    assert gguf_cache_dir(other) != gguf_cache_dir(first)  # one byte of the last tensor differs


def test_set_up_converts_the_default_model_and_says_where_or_why_not(monkeypatch, capsys):
    """`python -m batchserve.models` (make setup): the default model's folder, converted before any test starts it;
    without the model installed, the reason and exit code 0 (its first start would convert it)."""
    from batchserve.models import __main__ as setup_command
    from batchserve.models import loader

    try:
        path = resolve_model_path(None)
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"default model not installed: {exc}")
    assert setup_command.main() == 0
    assert capsys.readouterr().out == f"default model: converted ({loader.gguf_cache_dir(path)})\n"
    assert (loader.gguf_cache_dir(path) / "model_config.json").is_file()
    find_spec = loader.importlib.util.find_spec
    uninstalled = lambda name, *args: None if name == loader.DEFAULT_MODEL_PACKAGE else find_spec(name, *args)  # noqa: E731
    monkeypatch.setattr(loader.importlib.util, "find_spec", uninstalled)
    assert setup_command.main() == 0
    out = capsys.readouterr().out
    assert out.startswith("default model: not converted (the default model (SmolLM2-135M-Instruct GGUF) is not")
    assert out.endswith("its first start converts it\n")


def _same_tokenizer(ours, theirs) -> None:
    text = "Hello <|im_start|> world, 12345 caf\u00e9 \n\tend"
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert type(ours) is type(theirs)
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    assert ours.all_special_tokens == theirs.all_special_tokens and ours.eos_token_id == theirs.eos_token_id
    if theirs.chat_template:
        assert ours.apply_chat_template(chat, tokenize=False) == theirs.apply_chat_template(chat, tokenize=False)


def test_load_tokenizer_gives_autotokenizers_tokenizer_without_the_model_config_class(tmp_path):
    """load_tokenizer hands AutoTokenizer the model type itself where tokenizer_config.json names the class (so that
    the model's config class is not imported); the tokenizer is the one AutoTokenizer picks from the folder alone,
    and a folder whose tokenizer_config.json names no class is left to AutoTokenizer."""
    try:
        folder = ensure_gguf_cache(resolve_model_path(None))
    except Exception as exc:  # noqa: BLE001
        pytest.skip(f"default model not installed: {exc}")
    assert _named_class_config(folder).model_type == "llama"
    _same_tokenizer(load_tokenizer(folder), AutoTokenizer.from_pretrained(folder))
    tiny = tmp_path / "tiny"
    build_hf_model("qwen2", tiny)
    save_tokenizer(tiny)
    assert _named_class_config(tiny).model_type == "qwen2"
    _same_tokenizer(load_tokenizer(tiny), AutoTokenizer.from_pretrained(tiny))
    settings = json.loads((tiny / "tokenizer_config.json").read_text())
    (tiny / "tokenizer_config.json").write_text(
        json.dumps({k: v for k, v in settings.items() if k != "tokenizer_class"})
    )
    assert _named_class_config(tiny) is None
    _same_tokenizer(load_tokenizer(tiny), AutoTokenizer.from_pretrained(tiny))
