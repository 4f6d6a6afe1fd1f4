"""Model names as vLLM users pass them: a Hub id resolves through the local Hugging Face cache, offline;
one that is not cached fails in one line saying what to do, from the command line without a traceback."""

from __future__ import annotations

import json

import pytest

from batchserve.cli import main
from batchserve.models.loader import ModelLoadError, resolve_model_path

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hugging Face cache, and no network (HF_HUB_OFFLINE: a lookup must never download)."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    cache.mkdir()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    return cache


def cache_repo(cache, repo_id: str, files: dict[str, str]):
    """A repo laid out as huggingface_hub caches it: refs/main -> snapshots/<commit>/..."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(COMMIT)
    snapshot = repo / "snapshots" / COMMIT
    snapshot.mkdir(parents=True)
    for name, text in files.items():
        (snapshot / name).write_text(text)
    return snapshot


def test_a_cached_hub_id_is_its_snapshot_folder(hub_cache):
    snapshot = cache_repo(hub_cache, "SomeOrg/Tiny-Llama", {"config.json": json.dumps({"model_type": "llama"})})
    assert resolve_model_path("SomeOrg/Tiny-Llama") == snapshot


def test_a_cached_gguf_repo_is_its_one_gguf_file(hub_cache):
    snapshot = cache_repo(hub_cache, "SomeOrg/Tiny-GGUF", {"tiny.Q4_0.gguf": "", "README.md": ""})
    assert resolve_model_path("SomeOrg/Tiny-GGUF") == snapshot / "tiny.Q4_0.gguf"


def test_an_uncached_hub_id_says_how_to_get_it(hub_cache):
    with pytest.raises(ModelLoadError) as err:
        resolve_model_path("HuggingFaceTB/SmolLM2-360M-Instruct")
    message = str(err.value)
    assert "\n" not in message and "hf download HuggingFaceTB/SmolLM2-360M-Instruct" in message
    assert str(hub_cache) in message


def test_the_command_line_answers_a_missing_model_in_one_line(hub_cache, capsys):
    assert main(["generate", "--model", "HuggingFaceTB/SmolLM2-360M-Instruct", "hi", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith("batchserve generate: error: model "), err
