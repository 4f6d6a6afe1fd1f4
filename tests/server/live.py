"""A live server on loopback for tests: uvicorn in a thread, on a free port picked by the OS."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import uvicorn

from batchserve.entrypoints.openai.app import build_app
from batchserve.serving.metrics import parse_metrics


class LiveServer:
    def __init__(self, app, engine=None) -> None:
        self.app = app
        self.engine = engine
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=10)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self.thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.01)

    @property
    def async_engine(self):
        return self.app.state.async_engine

    def model_id(self) -> str:
        """The name the server answers to (its first /v1/models entry)."""
        return httpx.get(self.url + "/v1/models", timeout=10).json()["data"][0]["id"]

    def metrics(self) -> dict[str, float]:
        return parse_metrics(httpx.get(self.url + "/metrics", timeout=10).text)

    def wait_idle(self, timeout: float = 30.0) -> None:
        assert self.async_engine.wait_idle(timeout), "engine did not go idle"

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def start_server(engine, **kwargs) -> LiveServer:
    return LiveServer(build_app(engine, **kwargs), engine)


@contextlib.contextmanager
def server_process(script: str, timeout_s: float = 60.0) -> Iterator[tuple[subprocess.Popen, str]]:
    """`script` (a Python program taking its port as argv[1]) in a fresh interpreter from the repo root; yields
    (process, url) once /health answers, and kills the process afterwards if it is still running."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen([sys.executable, "-c", script, str(port)], cwd=root)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url, timeout_s)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def wait_for_health(proc: subprocess.Popen, url: str, timeout_s: float, interval_s: float = 0.1) -> None:
    """Until `url`/health answers 200, failing when `proc` exits or `timeout_s` passes. One client for every try:
    httpx.get() builds a client, and its TLS context, per call (~30 ms of CPU), so polling with it took a third of a
    core from the server it waited for."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as http:
        while True:
            try:
                if http.get(url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(interval_s)
