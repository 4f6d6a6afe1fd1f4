"""mkdocs hook: the configuration and environment pages' tables, generated at build time from the code they describe,
so that neither page can drift from it.

- `<!-- generated: engine-options -->` in a page becomes one table per config dataclass, from the options schema
  (batchserve/entrypoints/engine_options.py): every option, its flags, its config-file keys, type, default, choices
  and help text.
- `<!-- generated: mode-rules -->` becomes the mode table (batchserve/modes.py): which combinations of options run,
  are refused or fall back, and why.
- `<!-- generated: environment -->` becomes the table of every variable batchserve/env.py reads, taken from the
  docstrings of its functions, each of which must begin `NAME (default ...): what it does`. A function without that
  form fails the build instead of being left out.

Run as a script (`python docs/hooks/reference.py`) to print both tables.
"""

from __future__ import annotations

import ast
import enum
import re
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
ENV_FILE = REPO / "batchserve" / "env.py"
MARKERS = {
    "<!-- generated: engine-options -->": lambda: engine_options_markdown(),
    "<!-- generated: environment -->": lambda: environment_markdown(),
    "<!-- generated: mode-rules -->": lambda: mode_rules_markdown(),
}


def on_page_markdown(markdown: str, **_: Any) -> str:
    """The mkdocs event: each marker in a page's source replaced by its generated table."""
    for marker, generate in MARKERS.items():
        if marker in markdown:
            markdown = markdown.replace(marker, generate())
    return markdown


def _cell(text: str) -> str:
    """Text safe in a table cell: no column breaks, no angle brackets read as HTML."""
    return text.replace("|", "\\|").replace("\n", " ").replace("<", "&lt;").replace(">", "&gt;")


def _code(values: list[str]) -> str:
    return ", ".join(f"`{value}`" for value in values)


def _type_name(kind: Any) -> str:
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return "choice"
    return getattr(kind, "__name__", str(kind))


def _default(spec: Any) -> str:
    if spec.default is None:
        match = re.search(r"\(default: ([^)]*)\)", spec.help)
        return match.group(1) if match else "unset"
    value = spec.default.value if isinstance(spec.default, enum.Enum) else spec.default
    return f"`{value}`"


def _flags(spec: Any) -> list[str]:
    names = [spec.name, *spec.aliases]
    if spec.kind is bool:
        return [f"--{n.replace('_', '-')}" + f" / --no-{n.replace('_', '-')}" for n in names]
    return [f"--{n.replace('_', '-')}" for n in names]


def engine_options_markdown() -> str:
    """One table per config dataclass (engine, scheduler, KV cache), in the schema's order."""
    import dataclasses

    from batchserve.config import ALIASES, CacheConfig, EngineConfig, SchedulerConfig
    from batchserve.entrypoints.engine_options import SPECS

    sections = [("Engine", EngineConfig), ("Scheduler", SchedulerConfig), ("KV cache", CacheConfig)]
    header = (
        "| option | flags | config-file keys | type | default | choices | what it does |\n|---|---|---|---|---|---|---|"
    )
    parts = []
    for title, cls in sections:
        names = {field.name for field in dataclasses.fields(cls)}
        rows = []
        for spec in (s for s in SPECS if s.name in names):
            keys = [spec.name, *sorted(alias for alias, target in ALIASES.items() if target == spec.name)]
            choices = _code(list(spec.choices)) if spec.choices else ""
            help_text = re.sub(r"\s*\(default: [^)]*\)", "", spec.help)
            rows.append(
                f"| `{spec.name}` | {_code(_flags(spec))} | {_code(keys)} | {_type_name(spec.kind)} | "
                f"{_cell(_default(spec))} | {choices} | {_cell(help_text)} |"
            )
        if not rows:
            raise ValueError(f"the options schema has no option of {cls.__name__}")
        parts.append(f"### {title} options\n\n{header}\n" + "\n".join(rows))
    return "\n\n".join(parts)


def mode_rules_markdown() -> str:
    """The mode table (batchserve/modes.py): every rule, its verdict, why, and what would work or what runs."""
    from batchserve.modes import markdown_table

    return markdown_table()


_ENV_DOC = re.compile(r"^(?P<name>[A-Z][A-Z0-9_]+) \(default(?P<rest>.*)$", re.DOTALL)


def _split_default(rest: str) -> tuple[str, str]:
    """`' unset or "auto": the flags decide): text'` -> the default and the text after the closing parenthesis."""
    depth = 1
    for i, char in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(char, 0)
        if depth == 0:
            default, text = rest[:i].strip(), rest[i + 1 :].lstrip(":").strip()
            return default, text
    raise ValueError(f"unbalanced parentheses in {rest!r}")


def environment_variables(path: Path = ENV_FILE) -> list[tuple[str, str, str, str]]:
    """(variable, default, what it does, the env.py function that reads it) for every function of env.py."""
    tree = ast.parse(path.read_text())
    found = []
    for node in tree.body:
        if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
            continue
        doc = " ".join((ast.get_docstring(node) or "").split())
        match = _ENV_DOC.match(doc)
        if not match:
            raise ValueError(f"env.py: {node.name}()'s docstring must begin 'NAME (default ...): ...', got {doc!r}")
        default, text = _split_default(match.group("rest"))
        found.append((match.group("name"), default, text, node.name))
    if not found:
        raise ValueError("env.py defines no variable")
    return found


def environment_markdown() -> str:
    rows = [
        f"| `{name}` | {_cell(default) or 'unset'} | {_cell(text)} | `env.{function}()` |"
        for name, default, text, function in environment_variables()
    ]
    return "| variable | default | what it does | read by |\n|---|---|---|---|\n" + "\n".join(rows)


if __name__ == "__main__":
    print(engine_options_markdown(), "\n")
    print(mode_rules_markdown(), "\n")
    print(environment_markdown())
