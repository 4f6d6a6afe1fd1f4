"""The architectures this engine runs, keyed by Hugging Face `model_type` / `architectures` and GGUF
`general.architecture`. Each family module registers its specs when imported (`register`); the loader asks `lookup`
for a checkpoint's spec and refuses, with the list of supported ones, a checkpoint no spec claims, before it builds any
part of a model. Family modules are imported lazily (`_FAMILY_MODULES`), so this module costs nothing to import."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from batchserve.config import ConfigError

# Modules that register architectures when imported. One that does not exist yet is skipped; any other import error
# is a bug and propagates.
_FAMILY_MODULES = ("batchserve.models.llama", "batchserve.models.gemma", "batchserve.models.moe")


class ModelLoadError(ConfigError, RuntimeError):
    """The model cannot be found or is not one this engine runs (a ConfigError: the command line answers it in one
    line, not a traceback)."""


@dataclass(frozen=True)
class ArchitectureSpec:
    model_type: str  # HF config.json "model_type", e.g. "qwen3"
    hf_class_names: tuple[str, ...]  # HF "architectures", e.g. ("Qwen3ForCausalLM",)
    gguf_names: tuple[str, ...]  # GGUF general.architecture values (() if none)
    model_class: str  # "module:Class", imported lazily
    config_fields: Callable[[dict], dict] | None = None  # HF config.json dict -> extra ModelConfig kwargs
    exact: str = ""  # one line for the docs table: what is exact, what is approximated


_SPECS: dict[str, ArchitectureSpec] = {}
_loaded = False


def register(spec: ArchitectureSpec) -> None:
    """Add (or replace: a module re-imported registers again) the spec of `spec.model_type`."""
    _SPECS[spec.model_type] = spec


def _load_families() -> None:
    global _loaded
    if _loaded:
        return
    for name in _FAMILY_MODULES:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:  # the family exists but something it imports does not: a real error
                raise
    _loaded = True


def supported() -> list[ArchitectureSpec]:
    """Every registered architecture, by model_type."""
    _load_families()
    return [_SPECS[key] for key in sorted(_SPECS)]


def supported_summary() -> str:
    """One line naming every supported architecture (for error messages)."""
    specs = supported()
    hf = ", ".join(spec.model_type for spec in specs)
    gguf = ", ".join(sorted({name for spec in specs for name in spec.gguf_names}))
    return f"supported: Hugging Face model_type {hf}; GGUF architecture {gguf}"


def lookup(
    model_type: str | None = None, hf_class_names: Iterable[str] = (), gguf_name: str | None = None
) -> ArchitectureSpec:
    """The spec of a checkpoint: by model_type first, then by any of its HF class names, then by its GGUF
    architecture. Raises ModelLoadError naming every supported architecture when none matches."""
    _load_families()
    if model_type is not None and model_type in _SPECS:
        return _SPECS[model_type]
    classes = set(hf_class_names or ())
    for spec in _SPECS.values():
        if classes & set(spec.hf_class_names) or (gguf_name is not None and gguf_name in spec.gguf_names):
            return spec
    asked = [f"model_type {model_type!r}"] if model_type is not None else []
    asked += [f"architectures {sorted(classes)}"] if classes else []
    asked += [f"GGUF architecture {gguf_name!r}"] if gguf_name is not None else []
    raise ModelLoadError(f"{' / '.join(asked) or 'an unnamed architecture'} is not supported ({supported_summary()})")


def model_class(spec: ArchitectureSpec) -> type:
    """The model class a spec names ("module:Class"), imported now."""
    module_name, _, class_name = spec.model_class.partition(":")
    return getattr(importlib.import_module(module_name), class_name)
