"""How batchserve starts its child processes (the engine core, tensor-parallel ranks) and how a child tells that
the process that started it (its launcher) is gone.

**Forked from a warm interpreter.** A spawned child is a fresh interpreter that imports torch, transformers and
batchserve's engine again before it does anything: about 2 CPU-s at every start, which the test suite pays hundreds
of times and a server pays at each rank. With the "forkserver" start method (the default; BATCHSERVE_START_METHOD
chooses), the first child a process starts launches one forkserver, which imports those modules once (`PRELOAD`)
and then forks every later child of that process from itself. The forkserver only imports: it runs no torch
operation, so no OpenMP or BLAS thread pool exists in it to be inherited half-made; each child starts its own pools
when it first computes, as a spawned one does.

**What a forked child would not get from its launcher.** Its working directory and ``sys.path`` travel with
multiprocessing's preparation data, as for a spawned child; its environment does not (a forked child has the
forkserver's, frozen when the forkserver started). So the launcher's environment travels with the child's
arguments and the child adopts it (`adopt_environment`) before its target runs: a variable a test or an operator
set before starting a child (a forced kernel path, OMP_NUM_THREADS) reaches it either way.

**The launcher's death.** A forkserver child's parent process is the forkserver, not its launcher, so
``getppid()`` says nothing about the launcher (and the forkserver itself outlives it by a moment). The launcher
passes its pid; the child watches that process through a pidfd, which becomes readable once the process has
exited (killed or not), and which a channel waits on beside its socket (`ParentWatch`).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import select
import signal
import sys
from dataclasses import dataclass

from batchserve import env

# What a child imports before its target runs: named, not imported here (host depends on none of them), and a name
# that does not import is skipped by multiprocessing. The engine core's and a rank's modules pull in torch,
# transformers and the layers and models; the runner's, xgrammar (0.3 CPU-s more of each engine's build).
PRELOAD = (
    "torch",
    "transformers",
    "batchserve.engine.core_process",
    "batchserve.worker.rank_worker",
    "batchserve.worker.model_runner",
    "batchserve.host.forkserver_setup",  # last: it freezes what the others imported
)
START_METHODS = ("forkserver", "spawn")


def child_context(method: str | None = None) -> multiprocessing.context.BaseContext:
    """The multiprocessing context a batchserve child starts from: ``method``, else BATCHSERVE_START_METHOD."""
    method = method or env.start_method()
    if method not in START_METHODS:
        raise ValueError(f"BATCHSERVE_START_METHOD: {method!r} is not one of {', '.join(START_METHODS)}")
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload(list(PRELOAD))  # read when this process's forkserver starts (once)
    return context


def adopt_launcher(environ: dict[str, str]) -> None:
    """What a child takes from its launcher rather than from the forkserver, first thing: SIGTERM's default action
    (the forkserver ignores it: host/forkserver_setup.py) and the launcher's environment."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    adopt_environment(environ)


def adopt_environment(environ: dict[str, str]) -> None:
    """Make this process's environment the launcher's (a forked child holds the forkserver's). OMP_NUM_THREADS is
    read once, when torch loads OpenMP (in the forkserver): a launcher's other value is applied to torch here."""
    threads_before = os.environ.get("OMP_NUM_THREADS")
    if dict(os.environ) != environ:
        os.environ.clear()
        os.environ.update(environ)
    threads = environ.get("OMP_NUM_THREADS")
    if threads != threads_before and "torch" in sys.modules:
        count = _thread_count(threads)
        if count:
            sys.modules["torch"].set_num_threads(count)


def _thread_count(value: str | None) -> int | None:
    """What OpenMP makes of OMP_NUM_THREADS (its first level): unset means one thread per usable core."""
    if not value:
        return len(os.sched_getaffinity(0))
    try:
        return int(value.split(",")[0])
    except ValueError:
        return None


@dataclass
class ParentWatch:
    """Whether the launcher (a process this one did not necessarily descend from directly) still runs."""

    pid: int
    fd: int | None  # a pidfd of the launcher: readable once it has exited; None where pidfds are missing
    gone_at_start: bool = False

    @classmethod
    def of(cls, pid: int) -> ParentWatch:
        try:
            return cls(pid, os.pidfd_open(pid))
        except ProcessLookupError:  # it died before this child got this far
            return cls(pid, None, gone_at_start=True)
        except (AttributeError, OSError):  # no pidfd_open (an older kernel or another OS): poll the pid instead
            return cls(pid, None)

    def alive(self) -> bool:
        if self.gone_at_start:
            return False
        if self.fd is not None:
            return not select.select([self.fd], [], [], 0)[0]
        return _pid_running(self.pid)


def _pid_running(pid: int) -> bool:
    """The process exists and has not exited (an exited one stays a zombie until its own parent reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no /proc: existence is all kill can tell
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
