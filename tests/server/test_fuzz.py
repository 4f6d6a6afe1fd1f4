"""Schema fuzzing of the HTTP API (schemathesis, from the server's own OpenAPI document): whatever a client sends,
the answer is never a 5xx, and the server still serves afterwards with no KV block held."""

from __future__ import annotations

import httpx
import pytest
from hypothesis import HealthCheck, given, settings

from tests.lazy import LazyModule
from tests.server.fakes import fake_engine
from tests.server.live import start_server

# imported by the fuzzing test, not by every worker that collects this file (its pytest plugin is off: pyproject.toml)
schemathesis = LazyModule("schemathesis")


@pytest.fixture(scope="module")
def fuzzed_server():
    server = start_server(fake_engine(delay_s=0.0), max_body_bytes=64 * 1024)
    yield server
    server.stop()


def test_no_input_gets_a_server_error(fuzzed_server):
    # schemathesis' strategies driven by hypothesis directly (its pytest plugin does not run under pytest 9)
    schema = schemathesis.openapi.from_url(fuzzed_server.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions", "/tokenize"}
    for operation in operations:

        @given(case=operation.as_strategy())
        @settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck), database=None)
        def check(case):
            response = case.call(base_url=fuzzed_server.url, timeout=30)
            assert response.status_code < 500, (case.path, case.body, response.text)

        check()


def test_the_server_serves_after_the_fuzzing(fuzzed_server):
    # runs after the fuzzing in this module (pytest keeps file order)
    url = fuzzed_server.url
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok"}
    reply = httpx.post(url + "/v1/completions", json={"prompt": "abc", "max_tokens": 5}, timeout=30)
    assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] == 5
    fuzzed_server.wait_idle()
    assert fuzzed_server.metrics()["batchserve:kv_cache_blocks_used"] == 0
