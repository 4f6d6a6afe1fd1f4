"""The native kernels' build key: everything that changes the build is in it, nothing else, and a process that finds
its key built (set-up builds it) loads without building, whichever ninja its PATH would find first."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path

import pytest

from batchserve.layers import kernels
from batchserve.layers.kernels import build


def _fake_tool(folder: Path, name: str, version: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    script = folder / name
    script.write_text(f"#!/bin/sh\necho {version}\n")
    script.chmod(0o755)


def _key(monkeypatch, path: str, files: list[Path], cflags=("-O3",), flags="avx2 fma") -> str:
    monkeypatch.setenv("PATH", path)
    return build.build_key(files, list(cflags), flags)


def test_the_key_follows_ninja_the_compiler_the_sources_and_the_flags(tmp_path, monkeypatch):
    source = tmp_path / "a.cpp"
    source.write_text("int f() { return 1; }\n")
    _fake_tool(tmp_path / "old", "ninja", "1.11.1")
    _fake_tool(tmp_path / "new", "ninja", "1.13.2")
    system = os.environ["PATH"]
    old = _key(monkeypatch, f"{tmp_path / 'old'}{os.pathsep}{system}", [source])
    assert old == _key(monkeypatch, f"{tmp_path / 'old'}{os.pathsep}{system}", [source])  # stable
    assert old != _key(monkeypatch, f"{tmp_path / 'new'}{os.pathsep}{system}", [source])  # ninja's version
    monkeypatch.setenv("CXX", str(tmp_path / "new" / "ninja"))  # another "compiler"
    assert old != _key(monkeypatch, f"{tmp_path / 'old'}{os.pathsep}{system}", [source])
    monkeypatch.delenv("CXX")
    assert old != _key(monkeypatch, f"{tmp_path / 'old'}{os.pathsep}{system}", [source], cflags=("-O2",))
    assert old != _key(monkeypatch, f"{tmp_path / 'old'}{os.pathsep}{system}", [source], flags="avx2 fma avx512f")
    source.write_text("int f() { return 2; }\n")
    assert old != _key(monkeypatch, f"{tmp_path / 'old'}{os.pathsep}{system}", [source])


def test_a_missing_tool_is_part_of_the_key_not_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    assert build.tool_version("ninja") == "ninja: absent"


@pytest.mark.parametrize("activated", [False, True], ids=["venv-not-activated", "venv-activated"])
def test_a_built_key_loads_without_building_whatever_ninja_is_on_path(activated, tmp_path):
    if kernels.load() is None:
        pytest.skip("native kernels cannot be built here")
    _fake_tool(tmp_path, "ninja", "0.0.1-some-other-ninja")  # first on PATH: must not decide the key
    interpreter_bin = str(Path(sys.executable).parent)
    path = [str(tmp_path), "/usr/bin", "/bin"]
    env = dict(os.environ, PATH=os.pathsep.join([interpreter_bin, *path] if activated else path))
    code = "import logging; logging.basicConfig(level=logging.INFO); from batchserve.layers import kernels; print(kernels.load().__file__)"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "building the native CPU kernels" not in result.stderr
    assert result.stdout.strip() == kernels.load().__file__


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_process():
    if kernels.load() is None:
        pytest.skip("native kernels cannot be built here")
    directory = Path(kernels.load().__file__).parent
    with open(directory / "build.flock", "w") as handle:  # as a builder would hold it, so no process is mid-load
        fcntl.flock(handle, fcntl.LOCK_EX)
        (directory / "lock").write_text("")  # the file torch's lock leaves when its build is killed
    code = "from batchserve.layers import kernels; print(kernels.load().__file__)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == kernels.load().__file__
    assert not (directory / "lock").exists()
