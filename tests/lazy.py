"""Client libraries imported when a test first uses them, not when its file is collected.

Every test worker collects every file, so a library imported at a file's top is paid once per worker whether or not
that worker runs the file: sentence-transformers (with the training stack it brings: peft, scikit-learn, SciPy),
anthropic and openai took seconds of each worker's collection for the few files that use them."""

from __future__ import annotations

import importlib
from types import ModuleType


class LazyModule:
    """Stands for a module: the first attribute read imports it (a failed import raises there, in the test)."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._module: ModuleType | None = None

    def __getattr__(self, attribute: str):
        if attribute.startswith("_"):  # what pytest's collection asks of every name in a module (__test__, markers)
            raise AttributeError(attribute)
        if self._module is None:
            self._module = importlib.import_module(self._name)
        return getattr(self._module, attribute)


anthropic = LazyModule("anthropic")
openai = LazyModule("openai")
sentence_transformers = LazyModule("sentence_transformers")
