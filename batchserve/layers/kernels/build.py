"""Building the native CPU kernels: once per build key, in a folder of that key's own, said in the log while it runs.

The key holds everything that changes the compiled objects or how the build tool reads its own records: the CPU's
flags (the code is -march=native), the compile flags, the sources, torch (its headers and how this interpreter spells
its path), the C++ compiler and the ninja binary. Two ninja versions sharing one folder each read the other's log as
"command changed" and rebuild everything, silently; with the version in the key they never share one, and the
ninja installed beside this interpreter (a dependency of ours) is preferred to the one on PATH, so an activated and
a non-activated venv build once between them.

Only the sources this CPU runs are compiled (sources_for: the AVX-512 attention files where the CPU has AVX-512), and
while a build runs each finished object is logged with its count ("[5/21] decode_avx2.o, 41 s"), so a first build shows
its progress. Torch's headers are most of a file's compile time: one file includes <torch/extension.h> (pybind11,
bindings.cpp), the files that use ATen include aten_pch.h first, which is compiled once into a precompiled header
before the build tool starts (precompile), and the attention kernels include neither. The torch build tool runs
(CPU count + 2) compilers at once; the slowest file (the bindings) is handed to it first.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from batchserve import env

logger = logging.getLogger(__name__)

LDFLAGS = ["-fopenmp"]

# Sources compiled only where the CPU has the flag: each holds one instruction set's kernels, and the files that call
# them do so only under that instruction set's macro (isa.h), so a build without them links.
ISA_ONLY_SOURCES = {
    "decode_avx512.cpp": "avx512f",
    "decode_avx512_bf16.cpp": "avx512f",
    "prefill_avx512.cpp": "avx512f",
    "prefill_amx.cpp": "avx512f",
}
# The translation unit that includes pybind11: the slowest to compile, handed to the build tool first
BINDING_SOURCES = ("bindings.cpp",)
# The header of torch's headers that the ATen-using files include first, precompiled once per build (precompile)
PCH_HEADER = "aten_pch.h"


def sources_for(sources: list[Path], cpu_flags: str) -> list[Path]:
    """The sources this CPU runs (ISA_ONLY_SOURCES dropped where it lacks their flag), the binding ones first."""
    flags = set(cpu_flags.split())
    kept = [p for p in sources if ISA_ONLY_SOURCES.get(p.name, "") in flags | {""}]
    return sorted(kept, key=lambda p: (p.name not in BINDING_SOURCES, p.name))


def tool_version(command: str) -> str:
    """`command --version`'s first line with the binary it resolved to, or "absent" when there is none."""
    path = shutil.which(command)
    if path is None:
        return f"{command}: absent"
    try:
        result = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=False)
    except (OSError, subprocess.SubprocessError):
        return f"{path}: unrunnable"
    lines = (result.stdout or result.stderr).strip().splitlines()
    return f"{os.path.realpath(path)}: {lines[0] if lines else ''}"


@contextmanager
def interpreter_tools_first() -> Iterator[None]:
    """PATH with this interpreter's bin folder first while the build runs (torch calls `ninja` by name)."""
    saved = os.environ.get("PATH", "")
    os.environ["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), saved])
    try:
        yield
    finally:
        os.environ["PATH"] = saved


def build_key(files: list[Path], cflags: list[str], cpu_flags: str) -> str:
    """A short hash of everything that changes the build's output or its tools' bookkeeping (module docstring)."""
    parts = [
        cpu_flags,
        " ".join(cflags + LDFLAGS),
        *(p.read_text() for p in files),
        torch.__version__,
        torch.__file__,  # a symlinked venv spells torch's include path two ways: one folder per spelling
        tool_version(os.environ.get("CXX", "c++")),
        tool_version("ninja"),
    ]
    return hashlib.sha1("\0".join(parts).encode()).hexdigest()[:12]


@functools.cache
def build_or_load(sources: tuple[Path, ...], headers: tuple[Path, ...], cflags: tuple[str, ...], cpu_flags: str):
    """The compiled module of `sources` (which include `headers`), built first when this key has no library yet
    (logged, with its time); torch's lock on the folder makes concurrent processes wait for one build."""

    with interpreter_tools_first():
        return _build_or_load(sources, headers, cflags, cpu_flags)


def _build_or_load(sources: tuple[Path, ...], headers: tuple[Path, ...], cflags: tuple[str, ...], cpu_flags: str):
    key = build_key([*sources, *headers], list(cflags), cpu_flags)
    directory = env.kernel_build_dir() / key
    directory.mkdir(parents=True, exist_ok=True)
    name = f"batchserve_cpu_kernels_{key}"
    with _exclusive(directory):
        if (directory / f"{name}.so").exists():
            # the key covers the sources: a library under it is current, and loading it needs no build tool
            from torch.utils.cpp_extension import _import_module_from_library

            return _import_module_from_library(name, str(directory), True)
        return _load(directory, name, _copied_sources(directory, sources, headers), cflags)


def _copied_sources(directory: Path, sources: tuple[Path, ...], headers: tuple[Path, ...]) -> tuple[Path, ...]:
    """The sources and headers copied into the key's folder, built from there: the build tool's records then name
    paths inside the folder, so two checkouts with the same sources share one build instead of rebuilding each
    other's (their own paths differ)."""
    copies = directory / "src"
    copies.mkdir(exist_ok=True)
    for path in (*sources, *headers):
        target = copies / path.name
        if not target.exists() or target.read_bytes() != path.read_bytes():
            shutil.copyfile(path, target)
    return tuple(copies / path.name for path in sources)


def compile_flags(directory: Path, name: str, sources: tuple[Path, ...], cflags: tuple[str, ...]) -> list[str] | None:
    """The compiler and flags the build tool will compile `sources` with, as torch writes them into its build file
    (written here to a file of our own by the same torch function that load() calls), or None where this torch has no
    such function or it cannot be called so."""
    from torch.utils import cpp_extension

    path = directory / "flags.ninja"
    try:
        cpp_extension._write_ninja_file_to_build_library(
            path=str(path), name=name, sources=[str(p) for p in sources], extra_cflags=list(cflags),
            extra_cuda_cflags=[], extra_sycl_cflags=[], extra_ldflags=list(LDFLAGS), extra_include_paths=[],
            with_cuda=False, with_sycl=False, is_standalone=False,
        )  # fmt: skip
    except (AttributeError, TypeError) as error:
        logger.info("no precompiled header for the native CPU kernels: %s", error)
        return None
    values = dict(line.split(" = ", 1) for line in path.read_text().splitlines() if " = " in line)
    path.unlink()
    if "cxx" not in values or "cflags" not in values:
        return None
    return [*shlex.split(values["cxx"]), *shlex.split(values["cflags"]), *shlex.split(values.get("post_cflags", ""))]


def precompile(directory: Path, name: str, sources: tuple[Path, ...], cflags: tuple[str, ...], start: float) -> None:
    """aten_pch.h (beside the copied sources) compiled into aten_pch.h.gch with the flags the build tool then compiles
    the sources with: the compiler takes a precompiled header only when its flags match, and parses the header as text
    otherwise (a slower build, the same objects). Skipped where the header is not among the sources' headers, the flags
    cannot be known or the compile fails: each then only costs the time saved."""
    header = sources[0].parent / PCH_HEADER
    target = header.with_name(f"{PCH_HEADER}.gch")
    flags = compile_flags(directory, name, sources, cflags) if header.exists() else None
    if flags is None or target.exists():
        return
    partial = target.with_name(f"{target.name}.partial")  # renamed once whole: a killed compile leaves no bad header
    command = [*flags, "-x", "c++-header", str(header), "-o", str(partial)]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        logger.warning("precompiling %s failed, building without it: %s", PCH_HEADER, result.stderr[-2000:])
        partial.unlink(missing_ok=True)
        return
    os.replace(partial, target)
    logger.warning("[0/%d] %s.gch (torch's headers, precompiled), %.0f s", len(sources), PCH_HEADER,
                   time.perf_counter() - start)  # fmt: skip


@contextmanager
def _exclusive(directory: Path) -> Iterator[None]:
    """One process at a time builds or loads in `directory`, by a lock the kernel drops when its holder dies. torch's
    own lock is a file that a killed build leaves behind, on which every later process would wait for ever: while
    this lock is held, any such file is a leftover, and is removed."""
    with open(directory / "build.flock", "w") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # the holder may only be loading the library: say so, not that a build is under way
            logger.warning("waiting for another process to build or load the native CPU kernels in %s", directory)
            fcntl.flock(handle, fcntl.LOCK_EX)
        (directory / "lock").unlink(missing_ok=True)
        yield


def _load(directory: Path, name: str, sources: tuple[Path, ...], cflags: tuple[str, ...]):
    from torch.utils.cpp_extension import load as load_extension

    built = (directory / f"{name}.so").exists()
    if not built:
        logger.warning(
            "building the native CPU kernels into %s (once for this CPU, compiler and torch; minutes)", directory
        )
    start = time.perf_counter()
    if not built:
        precompile(directory, name, sources, cflags, start)
    with _progress_logged(directory, sources, start, quiet=built):
        module = load_extension(
            name=name,
            sources=[str(p) for p in sources],
            extra_cflags=list(cflags),
            extra_ldflags=LDFLAGS,
            build_directory=str(directory),
            verbose=False,
        )
    if not built:
        logger.warning("built the native CPU kernels in %.0f s", time.perf_counter() - start)
        # a key's library is loaded without the build tool from now on: the precompiled header (~100 MB) is not read
        (sources[0].parent / f"{PCH_HEADER}.gch").unlink(missing_ok=True)
    return module


@contextmanager
def _progress_logged(directory: Path, sources: tuple[Path, ...], start: float, quiet: bool) -> Iterator[None]:
    """While the body builds: each object file as it appears, "[k/N] name.o, T s" (the build tool's own output is
    captured by torch until it ends)."""
    if quiet:
        yield
        return
    done = threading.Event()
    objects = {f"{p.stem}.o" for p in sources}

    def watch() -> None:
        seen: set[str] = set()
        while not done.wait(1.0):
            for name in sorted(objects - seen):
                if (directory / name).exists():
                    seen.add(name)
                    logger.warning("[%d/%d] %s, %.0f s", len(seen), len(objects), name, time.perf_counter() - start)

    watcher = threading.Thread(target=watch, name="kernel-build-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
