"""Child-process targets for test_channel (module level, so that a spawned interpreter can import them)."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path

from batchserve.host.channel import Channel, PeerDeadError, start_child


@dataclass
class Note:
    text: str
    numbers: list[int]


def echo(channel: Channel) -> None:
    """Send back every message until the parent goes; a "stop" message ends it cleanly."""
    while True:
        try:
            message = channel.recv()
        except PeerDeadError:
            return
        if message == "stop":
            return
        channel.send(message)


def send_then_exit(channel: Channel, count: int, code: int) -> None:
    for i in range(count):
        channel.send(i)
    os._exit(code)  # no cleanup: the socket closes with the process


def silent(channel: Channel) -> None:
    """Alive and quiet until the parent goes."""
    try:
        channel.recv()
    except PeerDeadError:
        return


def fork_holder_then_wait(channel: Channel) -> None:
    """Fork a grandchild that inherits (and holds open) this end's socket, tell the parent its pid, then wait."""
    pid = os.fork()
    if pid == 0:
        time.sleep(20)
        os._exit(0)
    channel.send(pid)
    silent(channel)


def middle(channel: Channel, marker: str) -> None:
    """Start a grandchild that writes ``marker`` when it sees this process die; report its pid and wait."""
    grandchild = start_child(watch_parent, marker, name="grandchild")
    channel.send(grandchild.pid)
    silent(channel)
    grandchild.stop()


def watch_parent(channel: Channel, marker: str) -> None:
    started = time.monotonic()
    try:
        channel.recv()
    except PeerDeadError as exc:
        # written whole, then renamed: the test polls for the file and must never read it half written
        Path(marker + ".part").write_text(f"{time.monotonic() - started:.3f} {exc}")
        os.replace(marker + ".part", marker)


def hold_memory(channel: Channel) -> None:
    """On each message n, keep n more MB resident (written, so the pages are really there) and answer its pid."""
    held = []
    while True:
        try:
            megabytes = channel.recv()
        except PeerDeadError:
            return
        held.append(bytearray(b"\x01" * (megabytes << 20)))
        channel.send(os.getpid())


def report_start(channel: Channel, names: list[str]) -> None:
    """Answer what this child was started with: the named variables, torch's thread count, its parent's pid."""
    import torch

    channel.send(({name: os.environ.get(name) for name in names}, torch.get_num_threads(), os.getppid()))
    silent(channel)
