"""What a hostile client tried, answered as it should be: a clear 400 (never a 500 or a hang), the next request
served, and the engine loop's health and shutdown bounded in time."""

from __future__ import annotations

import gc
import json
import logging
import signal
import textwrap
import time

import httpx
import pytest

from batchserve.engine.async_engine import AsyncLLMEngine
from batchserve.entrypoints.openai.app import build_app
from tests.server.fakes import fake_engine
from tests.server.live import LiveServer, server_process, start_server
from tests.server.test_api import sse_events

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


@pytest.fixture(scope="module")
def server():
    # the pool (16 blocks x 16 = 256 tokens) is smaller than the context: it is the limit
    s = start_server(fake_engine(delay_s=0.002, num_kv_blocks=16, max_model_len=2048))
    yield s
    s.stop()


def post(server, path, body=None, **kwargs):
    return httpx.post(server.url + path, json=body, timeout=30, **kwargs)


def error_of(response, status=400):
    assert response.status_code == status, response.text
    return response.json()["error"]


def chat(content="hi", **fields):
    return {"messages": [{"role": "user", "content": content}], **fields}


def test_a_prompt_larger_than_the_pool_is_refused_naming_the_limit(server):
    error = error_of(post(server, COMPLETIONS, {"prompt": "a" * 300, "max_tokens": 4}))
    assert error["param"] == "prompt" and "KV cache holds" in error["message"]
    # fits the pool but not with its max_tokens: served until the pool is full, the small ones beside it too
    big = post(server, COMPLETIONS, {"prompt": "a" * 200, "max_tokens": 200, "ignore_eos": True})
    small = post(server, COMPLETIONS, {"prompt": "b", "max_tokens": 3})
    assert big.json()["choices"][0]["finish_reason"] == "length" and big.json()["usage"]["completion_tokens"] == 56
    assert small.json()["usage"]["completion_tokens"] == 3
    models = httpx.get(server.url + "/v1/models").json()["data"][0]
    assert models["max_model_len"] == 256  # what the engine enforces, not the model's 2048


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_chat_max_tokens_zero_is_refused(server, field):
    assert error_of(post(server, CHAT, chat(**{field: 0})))["param"] == "max_tokens"


@pytest.mark.parametrize(
    ("raw", "expect"),
    [
        (b'{"prompt": "\\ud800", "max_tokens": 2}', "surrogate"),
        (b'{"model": "\\ud800", "prompt": "a"}', "surrogate"),
        (b'{"prompt": "a", "temperature": NaN}', "NaN"),
        (b'{"prompt": "a", "temperature": Infinity}', "Infinity"),
        (b'{"prompt": ' + b"[" * 10000 + b"]" * 10000 + b"}", "nested too deeply"),
    ],
)
def test_hostile_json_is_a_400(server, raw, expect):
    for path in (COMPLETIONS, "/tokenize"):
        response = httpx.post(server.url + path, content=raw, headers={"content-type": "application/json"})
        assert expect in error_of(response)["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"prompt": "a", "ignore_eos": "yes"}, "ignore_eos"),
        ({"prompt": "a", "max_tokens": "4"}, "max_tokens"),
        ({"prompt": "a", "stop": ""}, "stop"),
        ({"prompt": "a", "stop": ["x"] * 100}, "stop"),
        ({"prompt": ["a"] * 3000, "max_tokens": 1}, "prompt"),
    ],
)
def test_values_of_the_wrong_kind_are_refused(server, body, param):
    assert error_of(post(server, COMPLETIONS, body))["param"] == param


def test_a_tiny_temperature_is_greedy(server):
    def text(temperature):
        return post(server, COMPLETIONS, {"prompt": "abc", "max_tokens": 8, "temperature": temperature}).json()

    assert text(1e-40)["choices"][0]["text"] == text(0)["choices"][0]["text"]


def test_a_huge_prompt_is_refused_before_it_is_tokenized(server):
    started = time.monotonic()
    error = error_of(post(server, COMPLETIONS, {"prompt": "word " * 700_000, "max_tokens": 1}))
    assert "at least" in error["message"] and error["param"] == "prompt"
    assert post(server, "/tokenize", {"prompt": "a" * 2_000_000}).status_code == 400
    assert time.monotonic() - started < 30  # a sanity bound only, not a timing test


def test_a_client_leaving_a_non_streamed_request_logs_no_error(server, caplog):
    caplog.set_level(logging.ERROR)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + COMPLETIONS, json={"prompt": "a", "max_tokens": 200, "ignore_eos": True}, timeout=0.1)
    server.wait_idle()
    gc.collect()
    time.sleep(0.2)
    assert not [r for r in caplog.records if "never retrieved" in r.getMessage()]
    assert server.metrics()["batchserve:kv_cache_blocks_used"] == 0


def test_health_reports_a_stalled_engine_loop():
    engine = fake_engine(delay_s=1.5)  # one step outlasts the stall timeout
    app = build_app(AsyncLLMEngine(engine), stall_timeout_s=0.3)
    server = LiveServer(app, engine)
    try:
        assert httpx.get(server.url + "/health").status_code == 200
        reply = {}

        def call():
            reply["r"] = httpx.post(server.url + COMPLETIONS, json={"prompt": "a", "max_tokens": 1}, timeout=30)

        import threading

        caller = threading.Thread(target=call)
        caller.start()
        time.sleep(0.8)
        health = httpx.get(server.url + "/health")
        assert health.status_code == 503 and "no progress" in health.json()["error"]["message"]
        caller.join(30)
        assert reply["r"].status_code == 200
        assert httpx.get(server.url + "/health").status_code == 200
    finally:
        server.stop()


DEADLINE_SCRIPT = textwrap.dedent(
    """
    import sys
    from batchserve.engine.async_engine import AsyncLLMEngine
    from batchserve.entrypoints.openai.app import build_app
    from batchserve.entrypoints.openai.launch import serve
    from tests.server.fakes import fake_engine
    async_engine = AsyncLLMEngine(fake_engine(delay_s=0.05))
    app = build_app(async_engine)
    sys.exit(serve(app, async_engine, port=int(sys.argv[1]), log_level="warning", drain_timeout=0.5))
    """
)


def test_sigterm_aborts_what_outlasts_the_drain_deadline():
    with server_process(DEADLINE_SCRIPT) as (proc, url):
        body = {"prompt": "a", "max_tokens": 200, "ignore_eos": True, "stream": True}  # ~10 s of steps
        with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=30) as r:
            lines = r.iter_lines()
            first = next(lines)
            signalled = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            events = sse_events([first, *lines])
        assert time.monotonic() - signalled < 8
        assert events[-1] == "[DONE]" and "error" in events[-2]
        assert proc.wait(30) == 1  # something was lost: the exit status says so


def test_the_server_still_serves(server):
    reply = post(server, CHAT, chat("hello", max_tokens=4))
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 4
    server.wait_idle()
    assert server.metrics()["batchserve:kv_cache_blocks_used"] == 0
    assert json.loads(httpx.get(server.url + "/health").text) == {"status": "ok"}
