"""`python -m tests.reaped_cpu <command...>`: a command's CPU seconds with every process it started counted, the ones
that outlived their parent too.

tests/cpu_seconds.py counts the children a test process reaps. A process re-parented away before it exits (Ray's
nodes and workers, a forkserver's children once the forkserver is gone) is reaped by init, and its CPU time is lost
to the figure. Here the command runs under a child subreaper (Linux's PR_SET_CHILD_SUBREAPER): orphans of its tree
are re-parented to this process, which reaps them all before it reports, so user + system time covers the whole tree.
The line it prints on stderr ends with the load average, since on a shared host that says what the wall time means.
"""

from __future__ import annotations

import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36  # linux/prctl.h


def run_reaped(command: list[str]) -> tuple[int, float, float, float]:
    """(exit status, user CPU-s, system CPU-s, wall s) of `command` and every process under it."""
    if ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed (Linux only)")
    started = time.monotonic()
    status = subprocess.call(command)
    while True:  # the orphans the command left behind are ours now: wait for the last of them
        try:
            os.wait()
        except ChildProcessError:
            break
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return status, usage.ru_utime, usage.ru_stime, time.monotonic() - started


if __name__ == "__main__":
    status, user, system, wall = run_reaped(sys.argv[1:])
    load = " ".join(f"{x:.1f}" for x in os.getloadavg())
    print(f"CPU {user + system:.1f} s (user {user:.1f}, system {system:.1f}), wall {wall:.0f} s, exit {status}, "
          f"load average {load}", file=sys.stderr)  # fmt: skip
    sys.exit(status)
