"""The server with its engine core in a process of its own (the default of `batchserve serve`): a real model's
greedy text equals transformers', SIGTERM drains (and its deadline aborts) through the core, and a killed core ends
every stream with an error while /health answers 503, within seconds, never a hang."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import time

import httpx
from transformers import AutoTokenizer

from tests.server.live import server_process
from tests.server.test_api import sse_events
from tests.tiny_models import hf_greedy, text_after, tiny_checkpoint

COMPLETIONS = "/v1/completions"

CORE_SCRIPT = textwrap.dedent(
    """
    import sys
    from batchserve.engine.core_client import EngineCoreClient
    from batchserve.entrypoints.openai.app import build_app
    from batchserve.entrypoints.openai.launch import serve
    from tests.server.fakes import fake_engine
    client = EngineCoreClient.launch(None, fake_engine, delay_s=0.05)
    open({pid_file!r}, "w").write(str(client.core_pid))
    sys.exit(serve(build_app(client), client, port=int(sys.argv[1]), log_level="warning", drain_timeout={drain}))
    """
)


def _core_server(tmp_path, drain: float = 30.0):
    pid_file = tmp_path / "core.pid"
    return server_process(CORE_SCRIPT.format(pid_file=str(pid_file), drain=drain)), pid_file


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_serve_runs_a_real_model_in_the_engine_process_as_transformers_does(tmp_path_factory):
    model, directory = tiny_checkpoint(tmp_path_factory, "llama", "tiny_llama_served_by_core")
    script = (
        "import sys; from batchserve.entrypoints.openai.launch import main; "
        f"sys.exit(main([{str(directory)!r}, '--port', sys.argv[1], '--dtype', 'float32', '--device', 'cpu', "
        "'--num-kv-blocks', '64', '--log-level', 'warning']))"
    )
    tokenizer = AutoTokenizer.from_pretrained(directory)
    prompt = [3, 17, 5, 40, 2]
    with server_process(script, timeout_s=120) as (proc, url):
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        reply = httpx.post(url + COMPLETIONS, json=body, timeout=60).json()
        assert reply["choices"][0]["text"] == text_after(tokenizer, prompt, hf_greedy(model, prompt, 6))
        metrics = httpx.get(url + "/metrics").text  # the core's steps reach this process's /metrics
        assert "batchserve:generation_tokens_total" in metrics
        generated = [line for line in metrics.splitlines() if line.startswith("batchserve:generation_tokens_total")]
        assert float(generated[0].split()[-1]) == 6
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0


def test_sigterm_drains_in_flight_requests_through_the_engine_process(tmp_path):
    server, pid_file = _core_server(tmp_path)
    with server as (proc, url):
        core = int(pid_file.read_text())
        with httpx.stream("POST", url + COMPLETIONS, json={"prompt": "a", "max_tokens": 30, "stream": True}) as r:
            lines = r.iter_lines()
            first = next(lines)
            proc.send_signal(signal.SIGTERM)
            events = sse_events([first, *lines])
        assert events[-1] == "[DONE]"
        assert sum(len(e["choices"][0]["text"]) for e in events[:-1] if e["choices"]) == 30
        assert proc.wait(30) == 0
        assert _gone(core)


def test_the_drain_deadline_aborts_through_the_engine_process(tmp_path):
    server, pid_file = _core_server(tmp_path, drain=0.5)
    with server as (proc, url):
        body = {"prompt": "a", "max_tokens": 200, "ignore_eos": True, "stream": True}  # ~10 s of steps
        with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=30) as r:
            lines = r.iter_lines()
            first = next(lines)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            events = sse_events([first, *lines])
        assert time.monotonic() - signalled < 8
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert proc.wait(30) == 1


def test_a_killed_engine_process_ends_streams_with_an_error_and_fails_health(tmp_path):
    server, pid_file = _core_server(tmp_path, drain=5.0)
    with server as (proc, url):
        core = int(pid_file.read_text())
        assert httpx.get(url + "/health").status_code == 200
        body = {"prompt": "a", "max_tokens": 200, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=30) as r:
            lines = r.iter_lines()
            first = next(lines)
            os.kill(core, signal.SIGKILL)
            killed = time.monotonic()
            events = sse_events([first, *lines])
        assert time.monotonic() - killed < 5
        assert events[-1] == "[DONE]" and "engine core process died" in json.dumps(events[-2])
        health = httpx.get(url + "/health")
        assert health.status_code == 503 and "engine core process died" in health.json()["error"]["message"]
        refused = httpx.post(url + COMPLETIONS, json={"prompt": "a", "max_tokens": 2}, timeout=10)
        assert refused.status_code == 503
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(15) in (0, 1)


def test_health_and_503_do_not_wait_for_a_long_step(tmp_path):
    """Steps of 1.5 s in the core: /health and a full queue's 503 are answered here without waiting for one."""
    pid_file = tmp_path / "core.pid"
    script = CORE_SCRIPT.replace("delay_s=0.05", "delay_s=1.5, max_waiting_requests=1, max_batch_size=1")
    with server_process(script.format(pid_file=str(pid_file), drain=0.5)) as (proc, url):
        with httpx.Client(timeout=30) as http:
            body = {"prompt": "a", "max_tokens": 50, "ignore_eos": True, "stream": True}
            streams = [http.stream("POST", url + COMPLETIONS, json=body) for _ in range(2)]
            responses = [s.__enter__() for s in streams]  # one runs, one waits: the queue is full
            times = []
            for _ in range(4):
                started = time.monotonic()
                assert http.get(url + "/health").status_code == 200
                assert http.post(url + COMPLETIONS, json={"prompt": "a", "max_tokens": 1}).status_code == 503
                times.append(time.monotonic() - started)
            for stream in streams:
                stream.__exit__(None, None, None)
            assert responses[0].status_code == 200
        assert max(times) < 1.0, times  # both answers together, within less than one step (1.5 s)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) in (0, 1)
