"""Where the native kernel build's CPU time goes: each translation unit compiled alone, one after the other.

    .venv/bin/python benchmarks/kernel_build.py                      # every source of this CPU's build
    .venv/bin/python benchmarks/kernel_build.py --only bindings.cpp,quant_w8a8.cpp --repeat 3

Builds the kernels first where this checkout's key has no build (layers/kernels/build.py), then reads that build's
own compile command and flags from the build file it left in its folder, copies its sources into a scratch folder,
precompiles aten_pch.h there and compiles each source with the header, one at a time. Each figure is the CPU time
(user + system) of that one compiler process, not wall time, so that a host other work shares inflates it little; the
build's critical path is the header, then the longest file that waits for it. The sum is what the build spends on
compiles (the link is not counted), the build tool's three compiles at a time aside.
"""

from __future__ import annotations

import argparse
import re
import resource
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from batchserve.bench.machine import describe, machine_info
from batchserve.layers import kernels
from batchserve.layers.kernels.build import PCH_HEADER


def children_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def timed(command: list[str], cwd: Path) -> float:
    """CPU seconds of `command` (it must succeed)."""
    start = children_cpu_s()
    result = subprocess.run(command, cwd=cwd, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"{' '.join(command)} failed:\n{result.stderr[-4000:]}")
    return children_cpu_s() - start


def build_file_of_this_checkout() -> Path:
    """The build file torch wrote for this checkout's sources (building them first where they are not built)."""
    module = kernels.load()
    if module is None:
        sys.exit("the native kernels cannot be built here")
    return Path(module.__file__).parent / "build.ninja"


def read_build_file(path: Path) -> tuple[str, list[str], list[Path]]:
    """The compiler, its flags and the sources (in the build file's order) of a torch build file."""
    text = path.read_text()
    compiler = re.search(r"^cxx = (.*)$", text, re.M).group(1).strip()
    flags = re.search(r"^cflags = (.*)$", text, re.M).group(1).split()
    sources = [Path(m) for m in re.findall(r"^build \S+\.o: compile (\S+)", text, re.M)]
    return compiler, flags, sources


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default="", help="comma-separated source names (default: all)")
    parser.add_argument("--repeat", type=int, default=1, help="compiles of each file; the cheapest is reported")
    args = parser.parse_args()
    compiler, flags, sources = read_build_file(build_file_of_this_checkout())
    wanted = set(filter(None, args.only.split(",")))
    print(describe(machine_info()))
    with tempfile.TemporaryDirectory(prefix="kernel-build-") as scratch:
        folder = Path(scratch)
        for copied in (*sources[0].parent.glob("*.h"), *sources[0].parent.glob("*.cpp")):  # a unit includes sources
            shutil.copyfile(copied, folder / copied.name)
        header_s = min(
            timed([compiler, *flags, "-x", "c++-header", PCH_HEADER, "-o", f"{PCH_HEADER}.gch"], folder)
            for _ in range(args.repeat)
        )
        rows = [(PCH_HEADER, header_s, "")]
        for source in sources:
            if wanted and source.name not in wanted:
                continue
            seconds = min(
                timed([compiler, *flags, "-c", source.name, "-o", f"{source.stem}.o"], folder)
                for _ in range(args.repeat)
            )
            uses = "header" if f'#include "{PCH_HEADER}"' in source.read_text() else ""
            rows.append((source.name, seconds, uses))
    print(f"{'file':32s} {'CPU s':>7s}  includes {PCH_HEADER}")
    for name, seconds, uses in sorted(rows, key=lambda r: -r[1]):
        print(f"{name:32s} {seconds:7.1f}  {uses}")
    print(f"{'sum':32s} {sum(r[1] for r in rows):7.1f}")


if __name__ == "__main__":
    main()
