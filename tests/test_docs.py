"""The docs site builds strictly (mkdocs.yml makes a page left out of the nav, a broken link or a missing anchor an
error), its generated reference pages list everything the code defines, and the README stays a front door."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200

pytest.importorskip("mkdocs", reason="mkdocs is in the dev extra")


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(out)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, f"mkdocs build --strict failed:\n{result.stdout}\n{result.stderr}"
    return out


def test_readme_is_short() -> None:
    lines = (REPO / "README.md").read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; the rest belongs in docs/"


def test_readme_links_point_at_files_that_exist() -> None:
    readme = (REPO / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links into the docs"
    for target in local:
        assert (REPO / target).exists(), f"README.md links to {target}, which does not exist"


def test_configuration_page_lists_every_option_of_the_schema(site: Path) -> None:
    from batchserve.config import ALIASES
    from batchserve.entrypoints.engine_options import SPECS

    page = (site / "configuration" / "index.html").read_text()
    assert "generated: engine-options" not in page
    for spec in SPECS:
        assert f"<code>{spec.name}</code>" in page, spec.name
        for alias in spec.aliases:
            assert f"<code>--{alias.replace('_', '-')}</code>" in page, alias
    for key in ALIASES:
        assert f"<code>{key}</code>" in page, key


def test_environment_page_lists_every_variable_env_py_reads(site: Path) -> None:
    page = (site / "environment" / "index.html").read_text()
    assert "generated: environment" not in page
    read = set(re.findall(r"""os\.environ\.get\(\s*["']([A-Z0-9_]+)["']""", (REPO / "batchserve/env.py").read_text()))
    assert read, "env.py reads no variable?"
    for name in read:
        assert f"<code>{name}</code>" in page, name
