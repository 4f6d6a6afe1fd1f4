"""Set-up hands pip's package sources to uv (tools/uv_pip_settings.py): what uv is told, from what pip lists."""

import importlib.util
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "uv_pip_settings.py"


@pytest.fixture(scope="module")
def settings_tool():
    spec = importlib.util.spec_from_file_location("uv_pip_settings", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_each_source_becomes_uv_arguments_once_in_pips_order(settings_tool):
    settings = [
        ("cert", "/etc/ssl/ca.crt"),
        ("find-links", "/wheels"),
        ("find-links", "/wheels"),  # the same setting from PIP_FIND_LINKS and from pip.conf
        ("constraint", "/etc/pip/constraints.txt"),
        ("extra-index-url", "file:///a/simple file:///b/simple"),
        ("index-url", "https://mirror.example/simple"),
        ("default-timeout", "180"),
    ]
    assert settings_tool.uv_arguments(settings) == [
        "--find-links", "/wheels",
        "--constraint", "/etc/pip/constraints.txt",
        "--extra-index-url", "file:///a/simple",
        "--extra-index-url", "file:///b/simple",
        "--index-url", "https://mirror.example/simple",
    ]  # fmt: skip


def test_pip_config_list_lines_are_read_back(settings_tool, monkeypatch):
    listing = ":env:.find-links='/wheels'\nglobal.extra-index-url='file:///a/simple'\n"

    class Listed:
        stdout = listing

    monkeypatch.setattr(settings_tool.subprocess, "run", lambda *args, **kwargs: Listed())
    assert settings_tool.pip_settings() == [("find-links", "/wheels"), ("extra-index-url", "file:///a/simple")]


def test_the_venvs_own_pip_answers(settings_tool):
    # the real `pip config list` of this interpreter: whatever it lists parses, and only uv's arguments come out
    arguments = settings_tool.uv_arguments(settings_tool.pip_settings())
    assert all(flag in settings_tool.UV_ARGUMENT.values() for flag in arguments[::2])
