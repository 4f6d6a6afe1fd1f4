"""`python -m tests.reaped_cpu <command...>`: a command's CPU seconds with every process it started counted, the ones
that outlived their parent too.

tests/cpu_seconds.py counts the children a test process reaps. A process re-parented away before it exits (Ray's
nodes and workers, a forkserver's children once the forkserver is gone) is reaped by init, and its CPU time is lost
to the figure. Here the command runs under a child subreaper (Linux's PR_SET_CHILD_SUBREAPER): orphans of its tree
are re-parented to this process, which reaps them all before it reports, so user + system time covers the whole tree.
A process whose parent ignores SIGCHLD (Ray's raylet does, for its workers: the replicas, actors and idle workers) is
reaped by the kernel the moment it exits, and its CPU time reaches no one's rusage. So the command's tree is also
sampled from /proc every SAMPLE_PERIOD_S: such a process, gone while its parent ignored SIGCHLD, is counted by its
last sample (its own time and what it had reaped itself), which misses at most its last period's CPU.
The line it prints on stderr ends with the load average, since on a shared host that says what the wall time means.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import NamedTuple

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h
SAMPLE_PERIOD_S = 0.25
SIGCHLD_BIT = 1 << 16  # SIGCHLD (17) in /proc/<pid>/status's SigIgn mask
TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


class Sample(NamedTuple):
    parent: int
    user_s: float  # its own and its waited-for children's
    system_s: float
    parent_ignores_sigchld: bool = False


def _processes() -> dict[int, Sample]:
    """Every process on the host now, from /proc/<pid>/stat."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        utime, stime, cutime, cstime = (int(x) * TICK_S for x in fields[11:15])
        found[int(entry.name)] = Sample(int(fields[1]), utime + cutime, stime + cstime)
    return found


def _ignores_sigchld(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(line for line in status.splitlines() if line.startswith("SigIgn:"))
    return bool(int(mask.split()[1], 16) & SIGCHLD_BIT)


class AutoReapedCounter(threading.Thread):
    """Samples the processes under this one, and keeps the last sample of each that was gone while its parent
    ignored SIGCHLD (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__(name="auto-reaped-counter", daemon=True)
        self._done = threading.Event()
        self._last: dict[int, Sample] = {}
        self._gone: dict[int, Sample] = {}

    def run(self) -> None:
        while not self._done.wait(SAMPLE_PERIOD_S):
            self.sample()

    def finish(self) -> None:
        self._done.set()
        self.join()
        self.sample()

    def sample(self) -> None:
        now = _tree(_processes(), os.getpid())
        ignoring = {parent for parent in {s.parent for s in now.values()} if _ignores_sigchld(parent)}
        self._gone.update((pid, s) for pid, s in self._last.items() if pid not in now and s.parent_ignores_sigchld)
        self._last = {pid: s._replace(parent_ignores_sigchld=s.parent in ignoring) for pid, s in now.items()}

    def cpu_s(self, reaped_here: set[int]) -> tuple[float, float]:
        """(user, system) seconds of the processes gone under a parent ignoring SIGCHLD, but those this process
        reaped itself (re-parented to it when that parent died in the same sampling period): rusage has them."""
        counted = [s for pid, s in self._gone.items() if pid not in reaped_here]
        return sum(s.user_s for s in counted), sum(s.system_s for s in counted)


def _tree(processes: dict[int, Sample], root: int) -> dict[int, Sample]:
    children: dict[int, list[int]] = {}
    for pid, sample in processes.items():
        children.setdefault(sample.parent, []).append(pid)
    tree, todo = {}, list(children.get(root, []))
    while todo:
        pid = todo.pop()
        tree[pid] = processes[pid]
        todo += children.get(pid, [])
    return tree


def run_reaped(command: list[str]) -> tuple[int, float, float, float]:
    """(exit status, user CPU-s, system CPU-s, wall s) of `command` and every process under it."""
    if ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed (Linux only)")
    started = time.monotonic()
    auto_reaped = AutoReapedCounter()
    auto_reaped.start()
    process = subprocess.Popen(command)
    status, reaped_here = process.wait(), {process.pid}
    while True:  # the orphans the command left behind are ours now: wait for the last of them
        try:
            reaped_here.add(os.wait()[0])
        except ChildProcessError:
            break
    auto_reaped.finish()
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    user, system = auto_reaped.cpu_s(reaped_here)
    user, system = usage.ru_utime + user, usage.ru_stime + system
    return status, user, system, time.monotonic() - started


if __name__ == "__main__":
    status, user, system, wall = run_reaped(sys.argv[1:])
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"CPU {user + system:.1f} s (user {user:.1f}, system {system:.1f}), wall {wall:.0f} s, exit {status}, "
          f"load average {load}", file=sys.stderr)  # fmt: skip
    sys.exit(status)
