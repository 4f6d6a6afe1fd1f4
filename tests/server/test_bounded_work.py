"""Expensive per-request work is bounded: a grammar compile that overruns is killed with its process (it used to
hold a core for the better part of an hour and keep the server from stopping), a constraint over the size cap is
refused unparsed, the caches of compiled grammars are bounded in bytes, and huge logit_bias / stop_token_ids lists
are refused by their length before any element is validated."""

from __future__ import annotations

import json
import os
import signal
import textwrap
import threading
import time

import httpx
import pytest

from batchserve.entrypoints.openai.bodies import json_value as _json
from batchserve.entrypoints.openai.errors import validation_error
from batchserve.entrypoints.openai.protocol import CompletionRequest
from batchserve.sampling_params import ConstraintKind, InvalidRequestError, StructuredOutputsParams
from batchserve.serving.grammar_pool import MAX_CONSTRAINT_BYTES, ConstraintCache
from batchserve.serving.structured import ConstraintChecker, json_schema_constraint
from batchserve.worker.structured_output import COMPILED_GRAMMAR_CACHE_BYTES, new_compiler
from tests.server.fakes import byte_tokenizer, fake_engine
from tests.server.live import server_process, start_server

COMPLETIONS = "/v1/completions"


def wide_schema(properties: int = 8000, description_chars: int = 100) -> dict:
    """The hostile probe's schema: thousands of required properties (1.3 MB with descriptions)."""
    names = [f"field_{i:05d}" for i in range(properties)]
    return {
        "type": "object",
        "properties": {
            name: {"type": "string"} | ({"description": "d" * description_chars} if description_chars else {})
            for name in names
        },
        "required": names,
    }


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as stat:  # a zombie (exited, not yet reaped) is not running
        return stat.read().split(")")[-1].split()[0] != "Z"


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds a live process has used (/proc/PID/stat, in clock ticks)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().split(")")[-1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.fixture(scope="module")
def server():
    s = start_server(fake_engine(delay_s=0.001))
    yield s
    s.stop()


def test_a_compile_over_its_time_is_refused_and_its_process_killed():
    checker = ConstraintChecker(byte_tokenizer(), timeout_s=1.0, max_constraint_bytes=4 << 20)
    try:
        small = json_schema_constraint({"type": "object", "properties": {"a": {"type": "integer"}}}, "guided_json")
        checker.check_blocking(small)  # starts the child (not counted against any compile's time)
        first_child = checker.pool.child_pid
        assert first_child is not None and alive(first_child)
        # past the front ends' size cap, so made directly: a schema that compiles for long enough to be killed
        wide = StructuredOutputsParams(ConstraintKind.JSON, json.dumps(wide_schema()), "response_format")
        started = time.monotonic()
        with pytest.raises(InvalidRequestError, match="took over 1 s to compile") as refused:
            checker.check_blocking(wide)
        assert time.monotonic() - started < 5.0
        assert refused.value.param == "response_format"
        assert not alive(first_child)  # killed: no core is left compiling it
        checker.check_blocking(json_schema_constraint({"type": "string"}, "guided_json"))  # a fresh child serves
        assert checker.pool.child_pid not in (None, first_child)
    finally:
        checker.close()
    assert checker.pool.child_pid is None


def test_a_constraint_over_the_size_cap_is_refused_before_it_is_parsed(server):
    body = {"prompt": "hi", "max_tokens": 2,
            "response_format": {"type": "json_schema", "json_schema": {"name": "wide", "schema": wide_schema()}}}  # fmt: skip
    assert len(json.dumps(body)) > MAX_CONSTRAINT_BYTES
    started = time.monotonic()
    response = httpx.post(server.url + COMPLETIONS, json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert f"more than the {MAX_CONSTRAINT_BYTES}" in response.json()["error"]["message"]
    assert time.monotonic() - started < 5.0  # refused by its size: no metaschema check (seconds a megabyte), no compile
    regex = httpx.post(
        server.url + COMPLETIONS, json={"prompt": "hi", "guided_regex": "a" * (MAX_CONSTRAINT_BYTES + 1)}
    )
    assert regex.status_code == 400 and "guided_regex" in regex.json()["error"]["message"]


def test_constraints_that_compiled_are_remembered_within_a_byte_bound():
    cache = ConstraintCache(limit_bytes=1000)
    keys = [("json", str(i) * 100) for i in range(10)]  # 164 bytes each with the per-entry overhead
    for key in keys[:6]:
        cache.add(key)
    assert keys[0] in cache  # used: now the most recent
    cache.add(keys[6])
    assert cache.size_bytes <= 1000
    assert keys[0] in cache and keys[1] not in cache  # the least recently used went first
    cache.add(("json", "x" * 5000))  # larger than the whole cache: not kept
    assert ("json", "x" * 5000) not in cache


def test_the_workers_compiled_grammar_cache_is_bounded_in_bytes():
    tokenizer = byte_tokenizer()
    compiler = new_compiler(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    assert compiler.cache_limit_bytes == COMPILED_GRAMMAR_CACHE_BYTES > 0


@pytest.mark.parametrize(
    ("field", "value"),
    [("logit_bias", {str(i): 1.0 for i in range(100_000)}), ("stop_token_ids", list(range(590_000)))],
)
def test_huge_lists_are_refused_by_their_length_before_their_elements(server, field, value):
    data = _json(json.dumps({"prompt": "a", field: value}).encode())
    started = time.perf_counter()
    with pytest.raises(Exception) as refused:  # noqa: PT011 - pydantic's ValidationError, answered 400 below
        CompletionRequest.model_validate(data)
    assert time.perf_counter() - started < 0.05  # was ~0.2-0.6 s of per-element validation and conversion
    error = validation_error(refused.value)
    assert error.status == 400 and error.param == field
    response = httpx.post(server.url + COMPLETIONS, json={"prompt": "a", field: value}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == field


@pytest.mark.parametrize("protect", [False, True])
def test_metrics_need_the_api_key_when_the_operator_says_so(protect):
    s = start_server(fake_engine(), api_key="s3cret", api_key_protects_metrics=protect)
    try:
        open_metrics = httpx.get(s.url + "/metrics", timeout=30)
        assert open_metrics.status_code == (401 if protect else 200)
        keyed = httpx.get(s.url + "/metrics", headers={"Authorization": "Bearer s3cret"}, timeout=30)
        assert keyed.status_code == 200 and "batchserve:" in keyed.text
        assert httpx.get(s.url + "/health", timeout=30).status_code == 200  # health stays open either way
    finally:
        s.stop()


def test_the_metrics_protection_is_a_serve_flag():
    from batchserve.entrypoints.openai.launch import make_parser

    assert make_parser().parse_args(["--api-key-protects-metrics"]).api_key_protects_metrics
    assert not make_parser().parse_args([]).api_key_protects_metrics


COMPILING_SERVER_SCRIPT = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    from batchserve.engine.async_engine import AsyncLLMEngine
    from batchserve.entrypoints.openai.app import build_app
    from batchserve.entrypoints.openai.launch import serve
    from batchserve.serving.structured import json_schema_constraint
    from tests.server.fakes import fake_engine
    async_engine = AsyncLLMEngine(fake_engine(delay_s=0.01))
    app = build_app(async_engine)
    checker = app.state.front.service.constraints
    checker.timeout_s, checker.max_constraint_bytes = 600.0, 4 << 20  # only the shutdown can stop this compile
    checker.check_blocking(json_schema_constraint({{"type": "string"}}, "guided_json"))  # the child, started
    Path({pid_file!r}).write_text(str(checker.pool.child_pid))
    sys.exit(serve(app, async_engine, port=int(sys.argv[1]), log_level="warning", drain_timeout=2))
    """
)


def test_sigterm_during_a_compile_exits_within_the_drain_deadline_and_kills_the_compile(tmp_path):
    pid_file = tmp_path / "child.pid"
    with server_process(COMPILING_SERVER_SCRIPT.format(pid_file=str(pid_file)), timeout_s=180) as (proc, url):
        child = int(pid_file.read_text())
        assert alive(child)
        schema = json.dumps(wide_schema(properties=5000, description_chars=0), separators=(",", ":"))
        assert len(schema) < MAX_CONSTRAINT_BYTES  # under the front end's cap: it reaches the compiler
        body = {"prompt": "hi", "max_tokens": 2, "guided_json": schema}
        answer: dict = {}
        sender = threading.Thread(
            target=lambda: answer.setdefault("response", httpx.post(url + COMPLETIONS, json=body, timeout=120))
        )
        idle = cpu_seconds(child)
        sender.start()
        deadline = time.monotonic() + 60
        while cpu_seconds(child) < idle + 0.2:  # parsed, and compiling in the child
            assert time.monotonic() < deadline and sender.is_alive(), answer
            time.sleep(0.02)
        assert proc.poll() is None and sender.is_alive(), answer["response"].text
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        assert time.monotonic() - signalled < 20  # the 2 s drain, then the compile is killed, not waited for
        sender.join(30)
        assert not alive(child)
        # refused when the compile was cut; on a quiet host it may finish inside the drain, and the request is served
        assert answer["response"].status_code in (200, 400, 503)
