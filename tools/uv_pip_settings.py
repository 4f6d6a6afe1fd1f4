"""Print pip's package-source settings as `uv pip install` arguments, one per line (set-up: the Makefile's `install`).

uv reads only its own configuration: where pip is set up to find packages (find-links, index URLs and constraint
files, from pip.conf or PIP_* variables, as `pip config list` merges them), uv would look elsewhere and could resolve
different wheels (a local CPU build of torch, say, against the index's CUDA one). Run with the venv's python, whose
pip is asked.
"""

from __future__ import annotations

import ast
import subprocess
import sys

# pip's setting -> uv's argument; a setting holds one value or several separated by whitespace
UV_ARGUMENT = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
}


def pip_settings() -> list[tuple[str, str]]:
    """(name, value) of every setting `pip config list` shows ("global.find-links='/x'" -> ("find-links", "/x"))."""
    listing = subprocess.run(
        [sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False
    ).stdout
    settings = []
    for line in listing.splitlines():
        key, sep, value = line.partition("=")
        if sep:
            settings.append((key.rpartition(".")[2], ast.literal_eval(value)))
    return settings


def uv_arguments(settings: list[tuple[str, str]]) -> list[str]:
    """uv's arguments for the settings it has an equivalent of, each value once, in pip's order."""
    arguments: list[str] = []
    seen: set[tuple[str, str]] = set()
    for name, value in settings:
        if name not in UV_ARGUMENT:
            continue
        for item in value.split():
            if (name, item) not in seen:
                seen.add((name, item))
                arguments += [UV_ARGUMENT[name], item]
    return arguments


if __name__ == "__main__":
    print("\n".join(uv_arguments(pip_settings())))
