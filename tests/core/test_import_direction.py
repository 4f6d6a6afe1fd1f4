"""Imports run one way: config <- core <- host <- layers <- models <- worker <- engine <- serving <- entrypoints <-
distributed <- bench <- simulator <- doctor, with the CLI dispatcher (and the package's own __init__) on top. Every
import counts, at the top of a file or inside a function, so that no lazy import hides an arrow that runs back up.
And above serving nothing reaches into the worker: a front end, scale-out, bench or the simulator drives a model
through the engine, and takes process-wide set-up and memory probes from host/."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import batchserve

PACKAGE_DIR = Path(batchserve.__file__).parent

# Lowest first; a module may import its own layer and the layers below it. A name taken from the package itself
# (`from batchserve import __version__`) counts as batchserve.<name>, in the layer its definition needs.
LAYERS: list[tuple[str, ...]] = [
    (
        "batchserve.config",
        "batchserve.sampling_params",
        "batchserve.pooling_params",
        "batchserve.request",
        "batchserve.env",
        "batchserve.modes",
        "batchserve.mode_facts",
        "batchserve.__version__",
        "batchserve.SamplingParams",
        "batchserve.kv_retention",
        "batchserve.LoRARequest",
    ),  # fmt: skip
    ("batchserve.core",),
    ("batchserve.host",),  # process-wide settings and memory probes: torch, but no model
    ("batchserve.layers",),
    ("batchserve.models",),
    ("batchserve.worker",),
    ("batchserve.engine",),
    ("batchserve.serving",),
    ("batchserve.entrypoints", "batchserve.LLM"),  # the package's __getattr__ imports LLM on first use
    ("batchserve.distributed",),
    ("batchserve.bench",),
    ("batchserve.simulator",),  # replays bench's workloads and metrics on the real scheduler
    ("batchserve.doctor",),  # reads servers and bench traces, asks the simulator
    ("batchserve.cli", "batchserve"),
]


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest prefix that names `module`'s layer."""
    best, best_len = None, -1
    for index, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


@functools.cache  # by source text: each test parses the package afresh, a planted line included
def imported_modules(source: str, module: str, is_package: bool) -> frozenset[str]:
    """batchserve modules a source file imports, anywhere in it (relative imports resolved)."""
    found: set[str] = set()
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                parent = ".".join(parts[: len(parts) - node.level + 1])
                base = f"{parent}.{base}" if base else parent
            # `from pkg import name` imports the submodule pkg.name when there is one, else a name of pkg itself
            submodules = {f"{base}.{alias.name}" for alias in node.names if _is_module(f"{base}.{alias.name}")}
            if base == "batchserve":  # the package's own names, each where it is defined
                found.update(f"{base}.{alias.name}" for alias in node.names)
            else:
                found.update(submodules if len(submodules) == len(node.names) else submodules | {base})
    return frozenset(name for name in found if name == "batchserve" or name.startswith("batchserve."))


@functools.cache
def _is_module(name: str) -> bool:
    relative = Path(*name.split(".")[1:]) if "." in name else Path()
    return (PACKAGE_DIR / relative).with_suffix(".py").exists() or (PACKAGE_DIR / relative / "__init__.py").exists()


def back_arrows(files: dict[str, tuple[str, bool]]) -> list[str]:
    """'a -> b' for each import of a module b from a layer above a's. files: module -> (source, is_package)."""
    arrows = []
    for module, (source, is_package) in sorted(files.items()):
        own = layer_of(module)
        for target in sorted(imported_modules(source, module, is_package)):
            if layer_of(target) > own:
                arrows.append(f"{module} -> {target}")
    return arrows


def worker_imports_above_serving(files: dict[str, tuple[str, bool]]) -> list[str]:
    """'a -> b' for each import of a worker module b by a module a above serving (entrypoints and up)."""
    first, worker = layer_of("batchserve.entrypoints"), layer_of("batchserve.worker")
    arrows = []
    for module, (source, is_package) in sorted(files.items()):
        if layer_of(module) >= first:
            targets = imported_modules(source, module, is_package)
            arrows += [f"{module} -> {target}" for target in sorted(targets) if layer_of(target) == worker]
    return arrows


def package_files() -> dict[str, tuple[str, bool]]:
    files = {}
    for path in PACKAGE_DIR.rglob("*.py"):
        parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        module = ".".join(parts[:-1] if is_package else parts)
        files[module] = (path.read_text(), is_package)
    return files


def test_every_import_runs_down_the_layers():
    files = package_files()
    assert len(files) > 40 and "batchserve.core.scheduler" in files
    assert back_arrows(files) == []


def test_a_back_arrow_is_caught_wherever_it_hides():
    files = package_files()
    source, is_package = files["batchserve.layers.attention"]
    lazy = source + "\n\ndef _peek():\n    from batchserve.engine.llm_engine import LLMEngine\n    return LLMEngine\n"
    relative = files["batchserve.core.scheduler"][0] + "\nfrom ..worker import model_runner\n"
    files["batchserve.layers.attention"] = (lazy, is_package)
    files["batchserve.core.scheduler"] = (relative, False)
    assert back_arrows(files) == [
        "batchserve.core.scheduler -> batchserve.worker.model_runner",
        "batchserve.layers.attention -> batchserve.engine.llm_engine",
    ]


def test_a_back_arrow_from_bench_to_the_simulator_is_caught():
    """The circle tune once had: the measured tune handing --simulate to the simulator, which imports bench."""
    files = package_files()
    source, is_package = files["batchserve.bench.tune"]
    planted = source + "\n\ndef _simulated(argv):\n    from ..simulator.tune_sim import main\n    return main(argv)\n"
    files["batchserve.bench.tune"] = (planted, is_package)
    assert back_arrows(files) == ["batchserve.bench.tune -> batchserve.simulator.tune_sim"]


def test_nothing_above_serving_reaches_into_the_worker():
    assert worker_imports_above_serving(package_files()) == []


def test_a_front_end_or_the_simulator_importing_the_worker_is_caught():
    files = package_files()
    for module, line in [
        ("batchserve.engine.llm_engine", "from batchserve.worker import kv_cache"),  # the engine drives the worker
        ("batchserve.entrypoints.llm", "from batchserve.worker.device import resolve_device"),
        ("batchserve.simulator.profiler", "from batchserve.worker import kv_cache"),
    ]:
        source, is_package = files[module]
        files[module] = (source + f"\n\ndef _peek():\n    {line}\n", is_package)
    assert back_arrows(files) == []  # every one runs down the layers: only the rule above serving sees two
    assert worker_imports_above_serving(files) == [
        "batchserve.entrypoints.llm -> batchserve.worker.device",
        "batchserve.simulator.profiler -> batchserve.worker.kv_cache",
    ]


def test_the_packages_own_names_sit_where_they_are_defined():
    imported = imported_modules("from batchserve import LLM, __version__, env\n", "batchserve.serving.x", False)
    assert imported == {"batchserve.LLM", "batchserve.__version__", "batchserve.env"}
    assert layer_of("batchserve.LLM") > layer_of("batchserve.serving") > layer_of("batchserve.__version__")
