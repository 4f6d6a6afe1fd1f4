"""The suite's file order and its tables: tests/cpu_seconds.py counts a file's CPU time (its children's too),
tests/file_order.py merges the workers' tables into the one the order reads, and tests/reaped_cpu.py counts a
command's whole tree, the processes that outlived their parent too."""

from __future__ import annotations

import json
import re
import subprocess
import sys

from tests import file_order

pytest_plugins = ["pytester"]

BURNS_CPU = """
import subprocess, sys, time

def _spin(seconds):
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass

def test_here():
    _spin(0.3)

def test_in_a_child():
    subprocess.run([sys.executable, "-c", "import time\\nend = time.process_time() + 0.3\\nwhile time.process_time() < end: pass"], check=True)
"""


def test_a_files_cpu_seconds_count_its_children_and_skip_its_neighbours_waits(pytester, monkeypatch, tmp_path):
    pytester.makepyfile(test_burns=BURNS_CPU, test_waits="import time\n\ndef test_sleeps():\n    time.sleep(0.5)\n")
    monkeypatch.setenv("BATCHSERVE_CPU_SECONDS_DIR", str(tmp_path / "cpu"))
    pytester.runpytest_inprocess("-p", "tests.cpu_seconds").assert_outcomes(passed=3)
    (table,) = (tmp_path / "cpu").glob("*.json")
    seconds = {name.rsplit("/", 1)[-1]: value for name, value in json.loads(table.read_text()).items()}
    assert seconds["test_burns.py"] >= 0.6  # this process's 0.3 s and the child's 0.3 s
    assert seconds["test_waits.py"] < 0.3  # a sleep is no CPU time


def test_a_fixtures_set_up_is_counted_under_its_own_name(pytester, monkeypatch, tmp_path):
    pytester.makepyfile(
        test_fixtures="""
import time
import pytest

@pytest.fixture
def costly():
    end = time.thread_time() + 0.3
    while time.thread_time() < end:
        pass

@pytest.fixture
def cheap():
    return 1

def test_uses_both(costly, cheap):
    pass
"""
    )
    monkeypatch.setenv("BATCHSERVE_CPU_SECONDS_DIR", str(tmp_path / "cpu"))
    pytester.runpytest_inprocess("-p", "tests.cpu_seconds").assert_outcomes(passed=1)
    (table,) = (tmp_path / "cpu" / "fixtures").glob("*.json")
    seconds = {name.rsplit("::", 1)[-1]: value for name, value in json.loads(table.read_text()).items()}
    assert seconds["costly"] >= 0.3 and seconds["cheap"] < 0.1
    assert "(collection)" in seconds


def test_the_workers_tables_merge_into_one_listing_only_files_that_matter(tmp_path):
    (tmp_path / "gw0.json").write_text(json.dumps({"tests/a.py": 30.04, "tests/quick.py": 0.5}))
    (tmp_path / "gw1.json").write_text(json.dumps({"tests/b.py": 50.0, "tests/quick.py": 0.4}))
    assert file_order.cpu_seconds_per_file(tmp_path) == {"tests/b.py": 50.0, "tests/a.py": 30.0}


# a child that outlives its parent: re-parented before it exits, so only a subreaper sees its CPU time
ORPHAN_BURNS_CPU = """
import subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time\\nend = time.process_time() + 0.4\\nwhile time.process_time() < end: pass"])
"""


# a child whose parent ignores SIGCHLD, as Ray's raylet does for its workers: the kernel reaps it at exit, and its CPU
# time reaches no rusage (the parent outlives it, so no subreaper sees it either)
CHILD_OF_A_PARENT_IGNORING_SIGCHLD = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGCHLD, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c", "import time\\nend = time.process_time() + 1.0\\nwhile time.process_time() < end: pass"])
while os.path.exists(f"/proc/{child.pid}"):
    time.sleep(0.05)
time.sleep(1.0)  # the parent lives on a while, as a raylet does
"""


def test_reaped_cpu_counts_a_process_that_outlived_its_parent():
    """In a process of its own: a test worker that became a subreaper would reap the children of other tests."""
    command = [sys.executable, "-m", "tests.reaped_cpu", sys.executable, "-c", ORPHAN_BURNS_CPU]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    cpu = float(re.search(r"CPU ([0-9.]+) s", done.stderr).group(1))
    assert cpu >= 0.4, done.stderr  # the orphan's 0.4 s, counted though its parent had gone


def test_reaped_cpu_counts_a_child_the_kernel_reaped_for_a_parent_ignoring_sigchld():
    command = [sys.executable, "-m", "tests.reaped_cpu", sys.executable, "-c", CHILD_OF_A_PARENT_IGNORING_SIGCHLD]
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    cpu = float(re.search(r"CPU ([0-9.]+) s", done.stderr).group(1))
    assert cpu >= 0.7, done.stderr  # the child's 1.0 s but its last sampling period, once it was gone
