"""`pytest -p tests.cpu_seconds`: each test file's CPU seconds, written per worker to
$BATCHSERVE_CPU_SECONDS_DIR/<worker>.json (default: .pytest_cache/cpu_seconds).

On a host shared with other work the wall seconds of a JUnit report say more about the neighbours than about a file:
a file's cost here is the user + system time of its setup, call and teardown phases in the test process (all of its
threads) plus every child process reaped meanwhile (a server or Ray node a file starts is counted when the file stops
it). A process that outlives the file, or is re-parented away from the test process before it exits, is not counted
(Ray's nodes and workers: `python -m tests.reaped_cpu <command>` counts a whole command's tree, those included).
`python -m tests.file_order --cpu <dir>` turns the folder into file_seconds.json.

Beside it, <dir>/fixtures/<worker>.json: the CPU seconds of each fixture's own set-up (the fixtures it requests are
counted under their own names; teardown is left in the file's figure), keyed `<where it is defined>::<name>`, and
`(collection)`: what the worker spent before its first test (imports and collecting every file), which every worker
pays whatever files it runs. `python -m tests.cpu_seconds <dir>` prints both tables summed over the workers.
"""

from __future__ import annotations

import json
import os
import resource
from collections import Counter
from pathlib import Path

import pytest

_per_file: Counter = Counter()
_per_fixture: Counter = Counter()


def cpu_now() -> float:
    """User + system seconds of this process and of its reaped children so far."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def _file_of(item: pytest.Item) -> str:
    root = item.config.rootpath
    return item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else str(item.path)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem):
    start = cpu_now()
    yield
    _per_file[_file_of(item)] += cpu_now() - start


@pytest.hookimpl(hookwrapper=True)
def pytest_fixture_setup(fixturedef: pytest.FixtureDef, request: pytest.FixtureRequest):
    start = cpu_now()
    yield
    _per_fixture[f"{fixturedef.baseid or '(plugin)'}::{fixturedef.argname}"] += cpu_now() - start


def pytest_collection_finish(session: pytest.Session) -> None:
    # once: a test that runs pytest inside this process (pytester) collects again, with this module's hooks
    _per_fixture.setdefault("(collection)", cpu_now())


def _write(path: Path, counts: Counter) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    table = {name: round(seconds, 2) for name, seconds in counts.most_common()}
    path.write_text(json.dumps(table, indent=1) + "\n")


def pytest_sessionfinish(session: pytest.Session) -> None:
    if not _per_file:  # xdist's controller runs no test
        return
    folder = Path(
        os.environ.get("BATCHSERVE_CPU_SECONDS_DIR", session.config.rootpath / ".pytest_cache" / "cpu_seconds")
    )
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    _write(folder / f"{worker}.json", _per_file)
    _write(folder / "fixtures" / f"{worker}.json", _per_fixture)


def summed(folder: Path) -> Counter:
    totals: Counter = Counter()
    for table in sorted(folder.glob("*.json")):
        totals.update(json.loads(table.read_text()))
    return totals


if __name__ == "__main__":
    import sys

    folder = Path(sys.argv[1])
    for title, totals in (("files", summed(folder)), ("fixtures (set-up only)", summed(folder / "fixtures"))):
        print(f"{title}: {sum(totals.values()):.1f} CPU-s")
        for name, seconds in totals.most_common(int(sys.argv[2]) if len(sys.argv) > 2 else 40):
            print(f"  {seconds:8.1f}  {name}")
