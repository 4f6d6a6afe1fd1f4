"""The process channel's contract (batchserve/host/channel.py): whole messages in order, and a dead peer seen as
PeerDeadError within about a second on either side, never a hang."""

from __future__ import annotations

import os
import signal
import time

import pytest

from batchserve.host.channel import PeerDeadError, start_child
from tests.host import channel_peers
from tests.host.channel_peers import Note


def _pid_alive(pid: int) -> bool:
    """Running, not a zombie (an orphan's reaper may be slow to collect it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_round_trip_keeps_objects_and_order():
    child = start_child(channel_peers.echo, name="echo")
    try:
        sent = [Note("héllo", [1, 2, 3]), ValueError("a field"), b"\x00" * 300_000, *range(50)]
        for message in sent:
            child.channel.send(message)
        got = [child.channel.recv(timeout=30) for _ in sent]
        assert got[0] == sent[0]
        assert isinstance(got[1], ValueError) and got[1].args == ("a field",)
        assert got[2] == sent[2] and got[3:] == list(range(50))
        child.channel.send("stop")
        assert child.stop(timeout=10) == 0
    finally:
        child.stop(timeout=1)


def test_killed_child_raises_peer_dead_within_a_second():
    child = start_child(channel_peers.silent, name="victim")
    try:
        assert not child.channel.poll(0.2)  # alive and silent: no message, no error
        with pytest.raises(TimeoutError):
            child.channel.recv(timeout=0.2)
        os.kill(child.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(PeerDeadError, match="victim"):
            child.channel.recv()
        assert time.monotonic() - started < 2.0
        with pytest.raises(PeerDeadError):
            child.channel.send("anyone?")
    finally:
        child.stop(timeout=1)


def test_messages_sent_before_death_arrive_first_then_exit_code():
    child = start_child(channel_peers.send_then_exit, 3, 7, name="brief")
    try:
        assert [child.channel.recv(timeout=30) for _ in range(3)] == [0, 1, 2]
        with pytest.raises(PeerDeadError, match="exit code 7"):
            child.channel.recv(timeout=30)
    finally:
        child.stop(timeout=1)


def test_dead_child_seen_even_when_a_grandchild_holds_its_socket():
    """The socket stays open while a forked grandchild holds it (no EOF): the process sentinel still tells."""
    child = start_child(channel_peers.fork_holder_then_wait, name="holder")
    holder = child.channel.recv(timeout=30)
    try:
        os.kill(child.pid, signal.SIGKILL)
        started = time.monotonic()
        with pytest.raises(PeerDeadError):
            child.channel.recv()
        assert time.monotonic() - started < 2.0
    finally:
        os.kill(holder, signal.SIGKILL)
        child.stop(timeout=1)


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
def test_child_sees_its_parent_die(tmp_path, monkeypatch, method):
    """The grandchild's parent process is the middle one only when spawned; forked by the middle's forkserver it
    still sees the middle (its launcher) die."""
    monkeypatch.setenv("BATCHSERVE_START_METHOD", method)  # the middle adopts it and starts the grandchild so
    marker = tmp_path / "parent-died"
    middle = start_child(channel_peers.middle, str(marker), name="middle")
    grandchild = middle.channel.recv(timeout=30)
    try:
        os.kill(middle.pid, signal.SIGKILL)
        middle.process.join(5)
        deadline = time.monotonic() + 5
        while not marker.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert marker.exists(), "the grandchild never noticed its parent's death"
        seconds, message = marker.read_text().split(" ", 1)
        assert "parent process" in message
        deadline = time.monotonic() + 5
        while _pid_alive(grandchild) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _pid_alive(grandchild)
    finally:
        if _pid_alive(grandchild):
            os.kill(grandchild, signal.SIGKILL)
        middle.stop(timeout=1)


def test_stop_closes_the_channel_and_the_child_exits():
    child = start_child(channel_peers.silent, name="quiet")
    assert child.stop(timeout=10) == 0
    assert child.channel.closed
    with pytest.raises(PeerDeadError, match="closed"):
        child.channel.send(1)


def test_a_forked_child_takes_its_launchers_environment_and_threads(monkeypatch):
    """Forked from the forkserver (whose environment froze when it started), each child still gets the environment
    its launcher had when it started it, OMP_NUM_THREADS included."""
    names = ["BATCHSERVE_TEST_MARK", "OMP_NUM_THREADS"]
    for mark, threads in (("first", 1), ("second", 2)):
        monkeypatch.setenv("BATCHSERVE_TEST_MARK", mark)
        monkeypatch.setenv("OMP_NUM_THREADS", str(threads))
        child = start_child(channel_peers.report_start, names, name="env-probe", start_method="forkserver")
        try:
            environ, torch_threads, parent = child.channel.recv(timeout=60)
            assert environ == {"BATCHSERVE_TEST_MARK": mark, "OMP_NUM_THREADS": str(threads)}
            assert torch_threads == threads
            assert parent != os.getpid()  # the forkserver's child: getppid() could not have told its launcher's death
        finally:
            child.stop(timeout=10)


def test_an_unknown_start_method_is_refused_by_name(monkeypatch):
    monkeypatch.setenv("BATCHSERVE_START_METHOD", "fork")
    with pytest.raises(ValueError, match="BATCHSERVE_START_METHOD: 'fork'"):
        start_child(channel_peers.silent, name="never")


def test_the_forkserver_has_one_thread_and_outlives_a_sigterm_to_the_whole_group():
    """The forkserver only imported torch: one thread, no OpenMP or BLAS pool for a child to inherit half-made. A
    service manager's SIGTERM reaches it too: it ignores it, or its children would read as dead (their exit codes
    come through it); each child itself still ends on SIGTERM."""
    child = start_child(channel_peers.report_start, [], name="term-probe", start_method="forkserver")
    try:
        _, _, forkserver = child.channel.recv(timeout=60)
        with open(f"/proc/{forkserver}/comm") as f:
            assert f.read().strip() == "bs-forkserver"
        assert len(os.listdir(f"/proc/{forkserver}/task")) == 1
        os.kill(forkserver, signal.SIGTERM)
        time.sleep(0.5)
        assert _pid_alive(forkserver) and child.is_alive()
        child.process.terminate()
        child.process.join(10)
        assert child.process.exitcode == -signal.SIGTERM
    finally:
        child.stop(timeout=1)
