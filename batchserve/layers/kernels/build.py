"""Building the native CPU kernels: once per build key, in a folder of that key's own, said in the log while it runs.

The key holds everything that changes the compiled objects or how the build tool reads its own records: the CPU's
flags (the code is -march=native), the compile flags, the sources, torch (its version and where its files really
are), the C++ compiler and the ninja binary. Two ninja versions sharing one folder each read the other's log as
"command changed" and rebuild everything, silently; with the version in the key they never share one, and the ninja
installed beside this interpreter (a dependency of ours) is preferred to the one on PATH, so an activated and
a non-activated venv build once between them.

Only the sources this CPU runs are compiled (sources_for: the AVX-512 attention files where the CPU has AVX-512), and
while a build runs each finished object is logged with its count ("[5/21] decode_avx2.o, 41 s"), so a first build shows
its progress. Torch's headers are most of a file's compile time: one file includes pybind11 with torch's tensor
casters (bindings.cpp; not <torch/extension.h>, whose C++ front end nothing here uses), the files that use ATen
include aten_pch.h first, which is compiled once into a precompiled header by an edge of the build itself
(header_precompiled_in_build: the files that wait for it are those that include it), and the attention and LoRA
kernels include neither, so they compile while the header does (it was a step before the build, a quarter of a minute
of one core with the other idle). The glue files, which call the kernels, compile as one translation unit
(GLUE_SOURCES): a third of their CPU time apart. The torch build tool runs CPU count + 2 compilers at once (3 on two cores); the
slowest files are handed to it first (COSTLIEST_FIRST).
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
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
    "prefill_avx512_bf16.cpp": "avx512_bf16",
    "lora_kernels_avx512.cpp": "avx512f",
}
# The sources that take longest to compile, longest first (CPU-seconds of one compile each on the AVX-512 EPYC, the
# header precompiled, benchmarks/kernel_build.py: bindings 16, the plain C++ LoRA kernel 8, W8A8 7, the AVX-512 LoRA
# kernels 7, the AVX-512 and AVX2 decode attention 8-10 and 6; the glue unit 6, the others 1-5). Handed to the build
# tool first, in this order, so that no long compile starts last and runs alone on one core at the end; bindings.cpp
# waits for the precompiled header, and is the first to start when it is done.
COSTLIEST_FIRST = (
    "bindings.cpp",
    "lora_kernels_portable.cpp",
    "quant_w8a8.cpp",
    "lora_kernels_avx512.cpp",
    "decode_avx512.cpp",
    "decode_avx2.cpp",
)
# The header of torch's headers that the ATen-using files include first, precompiled once per build
# (header_precompiled_in_build)
PCH_HEADER = "aten_pch.h"
# The glue files (shapes checked, ATen calls, a path's kernel called; no vector loop of their own) compiled as one
# translation unit, GLUE_UNIT, which includes them in this order: alone, each spent most of its 2-4 CPU-seconds
# loading the precompiled header (1.3 for an empty file) and compiling the same inline ATen functions as the others
# (20.6 CPU-s apart, 7.6 together). The kernels' own files stay one each, so that their code is compiled as before;
# a member must not leave a `using namespace` or a macro behind for the next.
GLUE_UNIT = "glue_unit.cpp"
GLUE_SOURCES = (
    "composed_ops.cpp",
    "decoder_loop.cpp",
    "lora_op.cpp",
    "paged_attention.cpp",
    "panel_brgemm.cpp",
    "projection.cpp",
    "quant_projection.cpp",
    "step_attention.cpp",
)


def sources_for(sources: list[Path], cpu_flags: str) -> list[Path]:
    """The sources this CPU runs (ISA_ONLY_SOURCES dropped where it lacks their flag), COSTLIEST_FIRST first in its
    order, then the others by name: the build tool starts ready compiles in the order of its build file."""
    flags = set(cpu_flags.split())
    kept = [p for p in sources if ISA_ONLY_SOURCES.get(p.name, "") in flags | {""}]
    rank = {name: i for i, name in enumerate(COSTLIEST_FIRST)}
    return sorted(kept, key=lambda p: (rank.get(p.name, len(rank)), p.name))


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
        " ".join(GLUE_SOURCES),  # which files compile together changes the objects
        *(p.read_text() for p in files),
        torch.__version__,
        # torch's own files, not how this interpreter spells their path: checkouts that link one venv share a build
        # (a folder with a library is loaded without the build tool, which is where a spelling would matter)
        os.path.realpath(torch.__file__),
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
    other's (their own paths differ). What the build tool compiles: the glue files as their unit (glued)."""
    copies = directory / "src"
    copies.mkdir(exist_ok=True)
    for path in (*sources, *headers):
        target = copies / path.name
        if not target.exists() or target.read_bytes() != path.read_bytes():
            shutil.copyfile(path, target)
    return glued(tuple(copies / path.name for path in sources))


def glued(sources: tuple[Path, ...]) -> tuple[Path, ...]:
    """`sources` with the GLUE_SOURCES among them replaced by GLUE_UNIT, written beside them (including them, the
    precompiled header first), where the first of them stood: what the build tool compiles."""
    members = [p for p in sources if p.name in GLUE_SOURCES]
    if not members:
        return sources
    unit = members[0].with_name(GLUE_UNIT)
    text = "".join(
        [f'#include "{PCH_HEADER}"  // first: the precompiled torch headers\n']
        + [f'#include "{p.name}"\n' for p in sorted(members, key=lambda p: GLUE_SOURCES.index(p.name))]
    )
    if not unit.exists() or unit.read_text() != text:
        unit.write_text(text)
    first = sources.index(members[0])
    rest = [p for p in sources if p.name not in GLUE_SOURCES]
    return (*rest[:first], unit, *rest[first:])


def with_precompiled_header(build_file: str, header: Path, users: set[str]) -> bool:
    """Torch's build file (written, its build tool not yet run) with `header` precompiled by an edge of its own, first
    in the file, and the objects of the sources in `users` (their names) waiting for it (order-only): the sources that
    include neither torch header compile beside it instead of after it. The compile rule's own flags, so that the
    compiler takes the header. A failed precompile only leaves no .gch (the users then parse the header as text: the
    same objects, slower). False, and the file as it was, where it has no compile rule to copy."""
    path = Path(build_file)
    lines = path.read_text().splitlines()
    first_edge = next((i for i, line in enumerate(lines) if line.startswith("build ")), None)
    if "rule compile" not in lines or first_edge is None:
        return False
    target = _ninja_path(header.with_name(f"{header.name}.gch"))
    for i, line in enumerate(lines):
        source = line.partition(": compile ")[2]
        if line.startswith("build ") and Path(source.strip()).name in users:
            lines[i] = f"{line} || {target}"
    edge = [
        "rule precompile_header",
        "  command = $cxx $cflags -x c++-header $in -o $out.partial $post_cflags && mv $out.partial $out"
        " || rm -f $out.partial",
        "  description = $out",
        f"build {target}: precompile_header {_ninja_path(header)}",
        "",
    ]
    path.write_text("\n".join([*lines[:first_edge], *edge, *lines[first_edge:]]) + "\n")
    return True


def _ninja_path(path: Path) -> str:
    """A path as a build file spells it: "$", spaces and colons (a build line's separator) escaped."""
    return str(path).replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


@contextmanager
def header_precompiled_in_build(sources: tuple[Path, ...]) -> Iterator[None]:
    """While torch's load() runs: its build file gets aten_pch.h's precompile as an edge of the build itself
    (with_precompiled_header), added between torch writing the file and running its build tool. Where torch has no
    such step to wrap, or the header is not among the sources' folder, the build runs without it."""
    from torch.utils import cpp_extension

    header = sources[0].parent / PCH_HEADER
    run_build_tool = getattr(cpp_extension, "_run_ninja_build", None)
    if run_build_tool is None or not header.exists():
        yield
        return
    users = {p.name for p in sources if f'#include "{PCH_HEADER}"' in p.read_text()}

    def run_with_header(build_directory: str, verbose: bool, error_prefix: str) -> None:
        if not with_precompiled_header(os.path.join(build_directory, "build.ninja"), header, users):
            logger.info("no precompiled header for the native CPU kernels: torch's build file has no compile rule")
        run_build_tool(build_directory, verbose, error_prefix)

    cpp_extension._run_ninja_build = run_with_header
    try:
        yield
    finally:
        cpp_extension._run_ninja_build = run_build_tool


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
    header = sources[0].parent / f"{PCH_HEADER}.gch"
    with _progress_logged(directory, sources, start, quiet=built), header_precompiled_in_build(sources):
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
        if not header.exists():
            logger.warning("%s did not precompile: the files that include it parsed it as text", PCH_HEADER)
        # a key's library is loaded without the build tool from now on: the precompiled header (~100 MB) is not read
        header.unlink(missing_ok=True)
    return module


@contextmanager
def _progress_logged(directory: Path, sources: tuple[Path, ...], start: float, quiet: bool) -> Iterator[None]:
    """While the body builds: the precompiled header and each object file as it appears, "[k/N] name, T s" (the
    build tool's own output is captured by torch until it ends)."""
    if quiet:
        yield
        return
    done = threading.Event()
    header = sources[0].parent / f"{PCH_HEADER}.gch"
    outputs = [
        *([header] if header.with_name(PCH_HEADER).exists() else []),
        *(directory / f"{p.stem}.o" for p in sources),
    ]

    def watch() -> None:
        seen: set[Path] = set()
        while not done.wait(1.0):
            for path in outputs:
                if path not in seen and path.exists():
                    seen.add(path)
                    logger.warning(
                        "[%d/%d] %s, %.0f s", len(seen), len(outputs), path.name, time.perf_counter() - start
                    )

    watcher = threading.Thread(target=watch, name="kernel-build-progress", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join()
