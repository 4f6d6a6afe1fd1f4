"""The docs speak about the project only: no words that point at its tracker or at how it was written (a design
brief's nickname, issue numbers, work sessions) and no machine's absolute paths. Separate from test_docs.py so that
it runs without mkdocs installed."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = sorted((REPO / "docs").rglob("*.md")) + [REPO / "README.md"]

# each pattern with what a reader would make of it
FOREIGN_WORDS = {
    r"\bseeds\b": "'seeds' (an outside document's name; also ambiguous next to sampling seeds)",
    r"\bissues?\s+#?\d+": "'issue N' (a tracker number means nothing to a reader of the docs)",
    r"\bsessions?\b": "'session' (work-log talk: say what changed, not who ran it when)",
    r"(?<![\w.])/(?:work|home|root|tmp)/": "an absolute path of one machine",
}


def foreign_words_in(text: str) -> list[str]:
    """'line N: what' for every forbidden word or path in `text`."""
    found = []
    for number, line in enumerate(text.splitlines(), start=1):
        for pattern, what in FOREIGN_WORDS.items():
            if re.search(pattern, line, flags=re.IGNORECASE):
                found.append(f"line {number}: {what}: {line.strip()[:100]}")
    return found


@pytest.mark.parametrize("page", DOCS, ids=lambda p: str(p.relative_to(REPO)))
def test_docs_use_no_words_from_outside_the_project(page: Path) -> None:
    found = foreign_words_in(page.read_text(encoding="utf-8"))
    assert not found, f"{page.relative_to(REPO)}:\n" + "\n".join(found)


def test_the_check_catches_each_kind_of_foreign_word() -> None:
    assert foreign_words_in("as the seeds put it") and foreign_words_in("the refactor (issue 41)")
    assert foreign_words_in("Issue #7 asks for it") and foreign_words_in("run in another session")
    assert foreign_words_in("see /work/main/docs")
    assert not foreign_words_in("a seeded request draws with `seed`; the tissue 4 of docs/index.md")
