"""The message channel between batchserve's processes: the API server <-> the engine core, the engine core <-> its
rank workers. One design for both links; this docstring is the contract each side relies on.

**What travels.** Any picklable Python object, pickled by ``multiprocessing``'s ForkingPickler (so once torch is
imported a CPU tensor travels through torch's shared-memory reduction: the receiver maps the sender's storage, no
copy, and the sender must stay alive until it is received; send numpy arrays or lists for a private copy).
Messages arrive whole and in order, one ``recv`` per ``send``. No schema is enforced here: each link declares its
own message dataclasses in its own module (a message's type is its class, never a string tag).

**Who calls what.** ``send`` may be called from any thread (a lock keeps messages whole). ``recv``/``poll`` belong
to ONE thread per channel end (the reader). A reader that must also do other work (an engine loop) calls
``poll(0)`` between its steps, or ``recv(timeout)``.

**Peer death.** Each end knows how to tell whether its peer lives: the parent holds the child's process sentinel,
the child a pidfd of the process that started it (host/children.py: under the forkserver its parent process is
not its launcher). ``recv`` and ``poll`` never block longer than ``liveness_interval`` (0.5 s) without checking; a
dead peer (killed, crashed, exited) makes ``send``, ``recv`` and ``poll`` raise ``PeerDeadError`` naming the peer and its exit code where known — within about a second, never a
hang. Queued messages the peer sent before it died are still delivered first. A peer that is alive but silent is
not an error here: a link that needs a deadline (a step reply) passes ``timeout`` to ``recv`` and gets
``TimeoutError``. ``send`` to a live peer that stopped reading blocks once the OS buffer fills (a socketpair); the
peer's death unblocks it with ``PeerDeadError``.

**Starting a child.** ``start_child(target, *args, name=...)`` starts ``target(channel, *args)`` in a new process
(forked from a forkserver that imported torch and the engine once, or spawned: host/children.py) and returns a
``ChildProcess`` holding the parent's end. ``target`` must be a module-level function; ``args`` must be picklable. The child's end is built by ``start_child``'s trampoline: the target gets a ready ``Channel``
whose peer is the parent. Closing: ``ChildProcess.stop(timeout)`` closes the channel (the child sees
``PeerDeadError`` on its next ``recv``/``poll`` and should exit), waits, then terminates and at last kills.

    child = start_child(echo_main, name="echo")
    child.channel.send("hi")
    assert child.channel.recv(timeout=5) == "hi"
    child.stop()
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from batchserve.host.children import ParentWatch, adopt_launcher, child_context
from batchserve.host.heap import start_memory_trace
from batchserve.host.process import name_process

LIVENESS_INTERVAL_S = 0.5  # the longest a recv/poll waits between two checks that the peer lives


class PeerDeadError(ConnectionError):
    """The process at the other end of a channel is gone (or the channel was closed); nothing more will come."""


class Channel:
    """One end of a duplex link to another process. See the module docstring for the contract."""

    def __init__(
        self,
        conn: multiprocessing.connection.Connection,
        peer: str,
        peer_alive: Callable[[], bool],
        peer_sentinel: int | None = None,
        peer_exitcode: Callable[[], int | None] | None = None,
        liveness_interval: float = LIVENESS_INTERVAL_S,
    ) -> None:
        self.peer = peer
        self._conn = conn
        self._peer_alive = peer_alive
        self._peer_sentinel = peer_sentinel
        self._peer_exitcode = peer_exitcode
        self._liveness_interval = liveness_interval
        self._send_lock = threading.Lock()
        self._closed = False

    # ------------------------------------------------------------------ any thread
    def send(self, message: Any) -> None:
        """Send one picklable object; raises PeerDeadError if the peer is gone (never silently drops)."""
        if self._closed:
            raise PeerDeadError(f"channel to {self.peer} is closed")
        try:
            with self._send_lock:
                self._conn.send(message)
        except (BrokenPipeError, ConnectionResetError, EOFError, OSError) as exc:
            raise self._dead_error() from exc

    # ------------------------------------------------------------------ the reader thread
    def poll(self, timeout: float | None = 0.0) -> bool:
        """True when a message is ready to ``recv``; False after ``timeout`` seconds (None: wait until one comes or
        the peer dies). Raises PeerDeadError once the peer is gone and nothing it sent is left."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = self._liveness_interval
            if deadline is not None:
                wait = max(0.0, min(wait, deadline - time.monotonic()))
            if self._readable(wait):
                return True
            if not self._peer_alive():
                if self._readable(0.0):  # a last message may have landed between the two checks
                    return True
                raise self._dead_error()
            if deadline is not None and time.monotonic() >= deadline:
                return False

    def recv(self, timeout: float | None = None) -> Any:
        """The next message; TimeoutError after ``timeout`` seconds without one; PeerDeadError if the peer died."""
        if not self.poll(timeout):
            raise TimeoutError(f"no message from {self.peer} within {timeout} s")
        try:
            return self._conn.recv()
        except (EOFError, ConnectionResetError, OSError) as exc:
            raise self._dead_error() from exc

    def _readable(self, timeout: float) -> bool:
        if self._closed:
            raise PeerDeadError(f"channel to {self.peer} is closed")
        try:
            waiting = [self._conn] if self._peer_sentinel is None else [self._conn, self._peer_sentinel]
            ready = multiprocessing.connection.wait(waiting, timeout)
            if self._conn in ready:
                # readable also means "closed by the peer": tell a message from an EOF without consuming it
                return self._conn.poll(0)
        except (EOFError, OSError) as exc:
            raise self._dead_error() from exc
        return False

    def _dead_error(self) -> PeerDeadError:
        code = self._peer_exitcode() if self._peer_exitcode is not None else None
        how = f" (exit code {code})" if code is not None else ""
        return PeerDeadError(f"{self.peer} is gone{how}")

    def fileno(self) -> int:
        return self._conn.fileno()

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._conn.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def peer_alive(self) -> bool:
        """Whether the peer process still runs (for a wait of the caller's own, e.g. a shared-memory all-reduce)."""
        return self._peer_alive()


@dataclass
class ChildProcess:
    """A started child and the parent's end of its channel."""

    process: multiprocessing.process.BaseProcess
    channel: Channel

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def is_alive(self) -> bool:
        return self.process.is_alive()

    def stop(self, timeout: float = 5.0) -> int | None:
        """Close the channel (the child's next recv/poll raises PeerDeadError and it should exit), wait up to
        ``timeout`` s, then SIGTERM, then SIGKILL. Returns the exit code."""
        self.channel.close()
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(2.0)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()
        return self.process.exitcode

    def kill(self) -> None:
        """SIGKILL the child (tests of peer death; a last resort)."""
        self.process.kill()
        self.process.join()


def start_child(
    target: Callable[..., Any],
    *args: Any,
    name: str,
    start_method: str | None = None,
    liveness_interval: float = LIVENESS_INTERVAL_S,
) -> ChildProcess:
    """Start ``target(channel, *args)`` in a new process named ``name``; returns the parent's end. The child is
    not a daemon (it may start its own children, e.g. rank workers); ``ChildProcess.stop`` ends it.
    ``start_method``: "forkserver" or "spawn" (default: BATCHSERVE_START_METHOD's)."""
    context = child_context(start_method)
    parent_conn, child_conn = context.Pipe(duplex=True)
    process = context.Process(
        target=_child_main,
        args=(target, child_conn, os.getpid(), liveness_interval, args, name, dict(os.environ)),
        name=name,
        daemon=False,
    )
    process.start()
    child_conn.close()  # the child holds the only copy now: its death closes the socket (EOF here)
    channel = Channel(
        parent_conn,
        peer=f"child process {name!r} (pid {process.pid})",
        peer_alive=process.is_alive,
        peer_sentinel=process.sentinel,
        peer_exitcode=lambda: _exit_code_soon(process),
        liveness_interval=liveness_interval,
    )
    return ChildProcess(process, channel)


def _exit_code_soon(process: multiprocessing.process.BaseProcess, wait_s: float = 1.0) -> int | None:
    """The child's exit code. Its socket's EOF can reach us before the kernel lets us reap it, so wait up to
    ``wait_s`` for the code rather than report a death without its cause."""
    if process.exitcode is None:
        process.join(wait_s)
    return process.exitcode


def short_process_name(name: str) -> str:
    """The name a child shows in `ps` (15 bytes kept): "batchserve-engine-core" becomes "bs-engine-core"."""
    return "bs-" + name.removeprefix("batchserve-")


def _child_main(
    target: Callable[..., Any],
    conn: multiprocessing.connection.Connection,
    parent_pid: int,
    liveness_interval: float,
    args: tuple[Any, ...],
    name: str,
    environ: dict[str, str],
) -> None:
    adopt_launcher(environ)
    name_process(short_process_name(name))
    start_memory_trace(short_process_name(name).removeprefix("bs-"))
    launcher = ParentWatch.of(parent_pid)
    channel = Channel(
        conn,
        peer=f"parent process (pid {parent_pid})",
        peer_alive=launcher.alive,
        peer_sentinel=launcher.fd,
        liveness_interval=liveness_interval,
    )
    try:
        target(channel, *args)
    finally:
        channel.close()
