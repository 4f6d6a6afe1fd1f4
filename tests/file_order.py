"""The order in which `make test` hands test files to its workers: the longest first.

With `--dist loadfile` each file goes whole to one worker (a module's server or model is set up once), so the suite's
wall time is at best its longest file and at worst a long file started last while the other worker sits idle.
Handing files out longest first (with --no-loadscope-reorder, so xdist keeps this order instead of sorting by the
number of tests) keeps both workers busy to the end. The seconds come from a measured run, kept in
file_seconds.json; a file it does not list (new, or too quick to matter) goes after those it lists, files with more
`slow` tests first.

Refresh the table after a full run that wrote a JUnit report:
    pytest -n auto --dist loadfile --junitxml=report.xml && python -m tests.file_order report.xml
or, on a host that other work shares (where a file's wall seconds are mostly its neighbours'), from each file's CPU
seconds (tests/cpu_seconds.py):
    pytest -n auto --dist loadfile -p tests.cpu_seconds && python -m tests.file_order --cpu .pytest_cache/cpu_seconds
"""

from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ElementTree
from collections import Counter
from pathlib import Path

from tests.cpu_seconds import summed

SECONDS_FILE = Path(__file__).with_name("file_seconds.json")
LISTED_ABOVE_S = 2.0  # files quicker than this are ordered by their slow tests, not listed


def measured_seconds() -> dict[str, float]:
    return json.loads(SECONDS_FILE.read_text()) if SECONDS_FILE.exists() else {}


def sort_longest_first(items, root: Path) -> None:
    """Sort pytest items in place: files by measured seconds, then by slow-test count; a file's tests stay
    together and in their order."""
    seconds = measured_seconds()
    slow_tests: Counter = Counter()
    for item in items:
        slow_tests[item.path] += item.get_closest_marker("slow") is not None

    def key(item):
        name = item.path.relative_to(root).as_posix() if item.path.is_relative_to(root) else str(item.path)
        return (-seconds.get(name, 0.0), -slow_tests[item.path])

    items.sort(key=key)


def seconds_per_file(junit_xml: Path) -> dict[str, float]:
    """{tests/x/test_y.py: seconds} summed over a JUnit report's test cases (setup, call and teardown)."""
    totals: Counter = Counter()
    for case in ElementTree.parse(junit_xml).iter("testcase"):
        parts = case.get("classname", "").split(".")
        module = [part for part in parts if not part[:1].isupper()]  # drop a test class's name
        totals["/".join(module) + ".py"] += float(case.get("time") or 0.0)
    return {name: round(total, 1) for name, total in totals.most_common() if total >= LISTED_ABOVE_S}


def cpu_seconds_per_file(folder: Path) -> dict[str, float]:
    """{tests/x/test_y.py: CPU seconds} from the per-worker tables tests/cpu_seconds.py wrote into `folder`."""
    totals = summed(folder)
    return {name: round(total, 1) for name, total in totals.most_common() if total >= LISTED_ABOVE_S}


if __name__ == "__main__":
    by_cpu = sys.argv[1] == "--cpu"
    table = cpu_seconds_per_file(Path(sys.argv[2])) if by_cpu else seconds_per_file(Path(sys.argv[1]))
    SECONDS_FILE.write_text(json.dumps(table, indent=1) + "\n")
    print(f"{SECONDS_FILE.name}: {len(table)} files, {sum(table.values()):.0f} {'CPU-s' if by_cpu else 's'}")
