"""benchmarks/newcomer.py's command extraction and failure rules, cheaply: the full run needs a fresh venv."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def newcomer():
    spec = importlib.util.spec_from_file_location("newcomer", ROOT / "benchmarks" / "newcomer.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["newcomer"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


README = """
Intro.

```bash
make run     # creates .venv
batchserve serve --port 8123 --max-batch-size 4   # a server
curl -s localhost:8123/v1/models -d '{"a": "#not a comment"}'
batchserve simulate --workload uniform \\
    --num-requests 10 --no-plots
```

```python
print("not a shell command")
```

```bash
batchserve serve --help
```
"""


def test_commands_come_from_bash_blocks_in_order(newcomer):
    commands = newcomer.extract_commands(README)
    assert [c.text for c in commands] == [
        "make run",
        "batchserve serve --port 8123 --max-batch-size 4",
        """curl -s localhost:8123/v1/models -d '{"a": "#not a comment"}'""",
        "batchserve simulate --workload uniform --num-requests 10 --no-plots",
        "batchserve serve --help",
    ]
    assert [c.server for c in commands] == [False, True, False, False, False]
    assert commands[1].port == 8123


def test_the_readme_has_commands_and_the_long_ones_are_skipped(newcomer):
    commands = newcomer.extract_commands((ROOT / "README.md").read_text())
    texts = [c.text for c in commands]
    assert any(t.startswith("batchserve ") for t in texts) and "make run" in texts
    assert all(re.search(newcomer.DEFAULT_SKIP, t) for t in texts if t.startswith("make test"))
    assert not re.search(newcomer.DEFAULT_SKIP, "make run")


def test_a_traceback_or_an_exit_status_fails_a_command(newcomer, tmp_path):
    python = sys.executable
    commands = [newcomer.Command(f"{python} -c 'print(1)'", False),
                newcomer.Command(f"{python} -c 'raise ValueError(3)'", False),
                newcomer.Command(f"{python} -c 'import sys; sys.exit(2)'", False)]  # fmt: skip
    results = newcomer.run_all(commands, dict(os.environ), 60, tmp_path)
    assert [line.split()[0] for line in results] == ["ok", "FAIL", "FAIL"]
    assert "printed a traceback" in results[1] and "exited 2" in results[2]
    assert "ValueError: 3" in (tmp_path / "01.log").read_text()


def test_a_command_past_its_time_is_stopped_with_its_children(newcomer):
    output, reason = newcomer.run_one("sleep 30 & echo started; wait", dict(os.environ), 1)
    assert reason == "ran past 1 s" and "started" in output
