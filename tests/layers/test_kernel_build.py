"""The native kernels' build key: everything that changes the build is in it, nothing else, and a process that finds
its key built (set-up builds it) loads without building, whichever ninja its PATH would find first."""

from __future__ import annotations

import fcntl
import os
import shutil
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


def test_the_precompiled_header_is_the_one_the_build_tool_compiles_with(tmp_path):
    """The build's own edge compiles aten_pch.h with the flags the sources are then compiled with, so the compiler
    takes it: the header asserts that it is compiled on its own (__BASE_FILE__ names it), which fails wherever a
    source parses it as text, and -Werror=invalid-pch fails a precompiled header the compiler refuses instead of
    skipping it. The build must pass, with the .gch made beside the header."""
    from torch.utils import cpp_extension

    if shutil.which(os.environ.get("CXX", "c++")) is None or not cpp_extension.is_ninja_available():
        pytest.skip("no C++ compiler or ninja here")
    source = tmp_path / "src" / "probe.cpp"
    source.parent.mkdir()
    header = source.with_name(build.PCH_HEADER)
    header.write_text(
        "#pragma once\n#include <string_view>\n#include <c10/util/Half.h>\n"  # light: the test is about the flags
        'static_assert(std::string_view(__BASE_FILE__).ends_with("aten_pch.h"), "parsed as text, not precompiled");\n'
    )
    source.write_text('#include "aten_pch.h"\nfloat probe(float x) { return static_cast<float>(c10::Half(x)); }\n')
    cflags = (*kernels.CFLAGS, "-Werror=invalid-pch")
    with build.interpreter_tools_first(), build.header_precompiled_in_build((source,)):
        cpp_extension.load(
            name="probe", sources=[str(source)], extra_cflags=list(cflags), extra_ldflags=build.LDFLAGS,
            build_directory=str(tmp_path), is_python_module=False, verbose=False,
        )  # fmt: skip
    assert (tmp_path / "probe.so").exists()
    assert header.with_name(f"{build.PCH_HEADER}.gch").exists()


def test_only_the_files_that_include_the_header_wait_for_its_precompile(tmp_path):
    """The precompile is the build file's first edge; an object whose source includes the header waits for it
    (order-only), the others start beside it."""
    header = tmp_path / "src" / build.PCH_HEADER
    build_file = tmp_path / "build.ninja"
    torch_written = [
        "cxx = c++", "cflags = -O3", "post_cflags = ", "rule compile", "  command = $cxx -MMD -MF $out.d $cflags -c $in -o $out",
        "", f"build uses.o: compile {tmp_path}/src/uses.cpp", f"build plain.o: compile {tmp_path}/src/plain.cpp",
        "build probe.so: link uses.o plain.o", "default probe.so",
    ]  # fmt: skip
    build_file.write_text("\n".join(torch_written) + "\n")
    assert build.with_precompiled_header(str(build_file), header, {"uses.cpp"})
    edges = [line for line in build_file.read_text().splitlines() if line.startswith("build ")]
    gch = f"{header}.gch"
    assert edges[0] == f"build {gch}: precompile_header {header}"
    assert edges[1] == f"build uses.o: compile {tmp_path}/src/uses.cpp || {gch}"
    assert edges[2] == f"build plain.o: compile {tmp_path}/src/plain.cpp"
    assert edges[3] == "build probe.so: link uses.o plain.o"
    build_file.write_text("rule link\n  command = $cxx $in -o $out\nbuild probe.so: link a.o\n")
    assert not build.with_precompiled_header(str(build_file), header, {"uses.cpp"})  # no compile rule: unchanged
    assert "precompile_header" not in build_file.read_text()


def test_checkouts_that_link_one_venv_share_the_key(tmp_path, monkeypatch):
    """A worktree whose .venv is a link to another checkout's spells torch's path through the link: the same torch
    builds the same objects, so it keys the same folder instead of building everything again."""
    source = tmp_path / "a.cpp"
    source.write_text("int f() { return 1; }\n")
    real = Path(build.torch.__file__).parents[1]
    (tmp_path / "linked").symlink_to(real)
    direct = build.build_key([source], ["-O3"], "avx2")
    monkeypatch.setattr(build.torch, "__file__", str(tmp_path / "linked" / "torch" / "__init__.py"))
    assert build.build_key([source], ["-O3"], "avx2") == direct


def test_the_glue_files_compile_as_one_unit_where_the_first_of_them_stood(tmp_path):
    """The build tool gets the glue unit instead of its members: the precompiled header first, then each member in
    GLUE_SOURCES' order; the other sources keep their order, and a build without the members is left as it is."""
    names = ["bindings.cpp", build.GLUE_SOURCES[1], "quant_w8a8.cpp", build.GLUE_SOURCES[0], "zz_kernel.cpp"]
    compiled = build.glued(tuple(tmp_path / n for n in names))
    assert [p.name for p in compiled] == ["bindings.cpp", build.GLUE_UNIT, "quant_w8a8.cpp", "zz_kernel.cpp"]
    lines = (tmp_path / build.GLUE_UNIT).read_text().splitlines()
    assert lines[0].startswith(f'#include "{build.PCH_HEADER}"')
    assert lines[1:] == [f'#include "{build.GLUE_SOURCES[0]}"', f'#include "{build.GLUE_SOURCES[1]}"']
    alone = (tmp_path / "bindings.cpp", tmp_path / "zz_kernel.cpp")
    assert build.glued(alone) == alone


def test_every_glue_file_exists_and_leaves_nothing_behind_for_the_next():
    """A member of the glue unit is a source of this folder that includes the precompiled header first, and has no
    file-wide `using namespace` or macro of its own, which would change how the members after it compile."""
    folder = Path(kernels.__file__).parent
    assert build.GLUE_UNIT not in {p.name for p in folder.glob("*.cpp")}
    for name in build.GLUE_SOURCES:
        text = (folder / name).read_text()
        includes = [line for line in text.splitlines() if line.startswith("#include")]
        assert includes[0].startswith(f'#include "{build.PCH_HEADER}"'), name
        assert not any(line.startswith(("using namespace", "#define")) for line in text.splitlines()), name


def test_which_files_compile_together_is_part_of_the_key(tmp_path, monkeypatch):
    source = tmp_path / "a.cpp"
    source.write_text("int f() { return 1; }\n")
    before = build.build_key([source], ["-O3"], "avx2")
    monkeypatch.setattr(build, "GLUE_SOURCES", build.GLUE_SOURCES[1:])
    assert build.build_key([source], ["-O3"], "avx2") != before


def test_the_amx_kernels_are_compiled_only_for_a_cpu_with_amx():
    """Without AMX the build has no AMX rows (their code would be called by nothing), and the emulated tiles, which
    the tests force on any CPU, are built all the same."""
    native = kernels.load()
    if native is None:
        pytest.skip("native kernels cannot be built here")
    isas = {isa for _, _, isa in native.kernel_table()}
    flags = kernels.cpu_flags().split()
    if not {"amx_tile", "amx_bf16"} <= set(flags):
        assert native.Isa.amx not in isas
    assert ("bf16_gemm", "bfloat16", native.Isa.portable) in set(native.kernel_table())


def test_the_build_benchmark_reads_the_compiler_flags_and_sources_torch_wrote(tmp_path):
    """benchmarks/kernel_build.py compiles each file with what the build file says: its compiler, its flags and its
    compile edges' sources, in order (the precompiled header's edge and the link are not sources)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "kernel_build_bench", Path(__file__).resolve().parents[2] / "benchmarks" / "kernel_build.py"
    )
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    build_file = tmp_path / "build.ninja"
    build_file.write_text(
        "cxx = c++\ncflags = -DX=1 -O3 -march=native\npost_cflags = \nrule compile\n  command = $cxx $cflags\n"
        f"build {tmp_path}/src/aten_pch.h.gch: precompile_header {tmp_path}/src/aten_pch.h\n"
        f"build b.o: compile {tmp_path}/src/b.cpp || {tmp_path}/src/aten_pch.h.gch\n"
        f"build a.o: compile {tmp_path}/src/a.cpp\nbuild m.so: link b.o a.o\n"
    )
    compiler, flags, sources = bench.read_build_file(build_file)
    assert compiler == "c++" and flags == ["-DX=1", "-O3", "-march=native"]
    assert sources == [tmp_path / "src" / "b.cpp", tmp_path / "src" / "a.cpp"]
