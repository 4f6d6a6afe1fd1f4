"""llama.cpp's `llama-server -np N` as a peer64 engine of benchmarks/peer_compare.py: a benchmark peer only.

The binary is built from the llama.cpp sources that llama-cpp-python vendors (the same commit as the `peers` extra),
see docs/quantization.md. The server runs the GGUF file itself (its quantized tensors, llama.cpp's default f16 KV
cache) with N parallel slots and continuous batching; every request goes to /completion as prompt token ids at once
(one client thread each), greedy, ignore_eos, exactly n_predict tokens, the tokens returned as ids.

Standard library only, like peer_compare.py's workers.
"""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

STARTUP_TIMEOUT_S = 120


def _die_with_parent() -> None:
    """In the server's process before exec: SIGTERM when the worker dies (peer_compare's --timeout kills the worker,
    whose `finally` then never runs), so no server outlives its benchmark (Linux; elsewhere a no-op)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _wait_healthy(base: str, server: subprocess.Popen) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"llama-server exited with {server.returncode} before it was ready")
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"llama-server not ready after {STARTUP_TIMEOUT_S} s")


def _complete(base: str, prompt_ids: list[int], n: int, timeout: float) -> list[int]:
    body = {
        "prompt": prompt_ids,
        "n_predict": n,
        "temperature": 0.0,
        "ignore_eos": True,
        "cache_prompt": True,
        "return_tokens": True,
        "stream": False,
    }
    return list(_post(base + "/completion", body, timeout)["tokens"])


def server_command(
    binary: Path, model: Path, port: int, slots: int, ctx_per_slot: int, threads: int, extra: list[str]
) -> list[str]:
    return [
        str(binary), "-m", str(model), "--host", "127.0.0.1", "--port", str(port),
        "-np", str(slots), "-c", str(slots * ctx_per_slot), "-t", str(threads), "-tb", str(threads),
        "--no-webui", "--log-disable", *extra,
    ]  # fmt: skip


def run(
    binary: Path, model: Path, requests: list[dict], slots: int, threads: int, timeout: float, extra: list[str]
) -> dict:
    """Start the server, warm it with one short request, then send every request at once; the server is stopped."""
    t0 = time.perf_counter()
    longest = max(len(r["prompt_token_ids"]) + r["max_tokens"] for r in requests)
    ctx_per_slot = max(1024, -(-longest // 256) * 256)
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    command = server_command(binary, model, port, slots, ctx_per_slot, threads, extra)
    server = subprocess.Popen(command, preexec_fn=_die_with_parent)
    try:
        _wait_healthy(base, server)
        _complete(base, requests[0]["prompt_token_ids"], 4, timeout)
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=len(requests)) as pool:
            futures = [pool.submit(_complete, base, r["prompt_token_ids"], r["max_tokens"], timeout) for r in requests]
            outputs = [f.result() for f in futures]
        wall_s = time.perf_counter() - t0
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    return {"load_s": load_s, "wall_s": wall_s, "outputs": outputs, "slots": slots, "model_file": model.name}
