"""`batchserve serve --replicas N`, the README's command, as a user runs it: a local Ray instance, the ingress serving
HTTP on --port itself (Ray Serve's proxy off), and a clean exit on SIGINT."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import httpx
import pytest

from batchserve.bench.soak import wait_ready
from batchserve.entrypoints.openai.launch import free_port

pytestmark = pytest.mark.slow


def test_serve_replicas_serves_http_from_the_ingress_and_exits_cleanly_on_sigint(tmp_path):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable, "-m", "batchserve.cli", "serve", "--replicas", "1", "--num-threads", "1", "--port", str(port),
        "--dtype", "float32", "--num-kv-blocks", "64", "--drain-timeout", "5",
    ]  # fmt: skip
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(server, url, timeout_s=300)
            body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            response = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert response.status_code == 200, response.text
            assert response.json()["usage"]["completion_tokens"] == 4
            server.send_signal(signal.SIGINT)
            assert server.wait(120) == 0
        finally:
            if server.poll() is None:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()
    text = log_path.read_text()
    assert "HTTP served by the ingress" in text, text[-2000:]
