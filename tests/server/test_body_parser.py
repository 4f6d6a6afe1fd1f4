"""Large bodies are parsed in the parser process (at a lower CPU priority), with the same answers as on the event
loop: the validated request, or the 400 naming the field; an unusable process falls back to a thread."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import BaseModel

from batchserve.entrypoints.openai.bodies import PARSER_NICE, BodyParser, NicedSpawnContext
from batchserve.entrypoints.openai.errors import APIError
from batchserve.entrypoints.openai.protocol import CompletionRequest
from batchserve.serving.grammar_pool import MAX_CONSTRAINT_BYTES


@pytest.fixture(scope="module")
def parser():
    parser = BodyParser()
    parser.start().result(timeout=120)
    yield parser
    parser.close()


def parse(parser: BodyParser, body: object, model: type[BaseModel] = CompletionRequest, lenient: bool = False):
    return asyncio.run(parser.parse(json.dumps(body).encode(), model, lenient))


def test_the_parser_process_runs_at_a_lower_priority(parser):
    assert parser.in_process
    child = parser.start().result()  # its pid
    assert child != os.getpid()
    assert os.getpriority(os.PRIO_PROCESS, child) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + PARSER_NICE)


def test_a_large_valid_body_comes_back_validated(parser):
    request = parse(parser, {"prompt": list(range(100_000)), "max_tokens": 3, "stop_token_ids": [5, 6]})
    assert isinstance(request, CompletionRequest)
    assert request.prompt == list(range(100_000)) and request.max_tokens == 3 and request.stop_token_ids == [5, 6]


def test_a_hostile_body_is_the_400_naming_its_field(parser):
    with pytest.raises(APIError) as refused:
        parse(parser, {"prompt": "x", "logit_bias": {str(i): 1 for i in range(100_000)}})
    assert (refused.value.status, refused.value.param) == (400, "logit_bias")
    with pytest.raises(APIError) as malformed:
        asyncio.run(parser.parse(b'{"prompt": NaN}', CompletionRequest, False))
    assert (malformed.value.status, malformed.value.code) == (400, "invalid_json")


def test_lenient_drops_unknown_fields_in_the_process_too(parser):
    request = parse(parser, {"prompt": list(range(50_000)), "no_such_field": 1}, lenient=True)
    assert len(request.prompt) == 50_000


def test_a_model_the_process_cannot_import_falls_back_to_a_thread(parser, caplog):
    class Local(BaseModel):  # defined in a function: pickle cannot name it for the child
        values: list[int]

    assert parse(parser, {"values": [1, 2, 3]}, Local).values == [1, 2, 3]
    assert "parsing this body on a thread" in caplog.text
    parser.start().result(timeout=120)  # the process is started again for the next body
    assert parse(parser, {"prompt": "x" * 100_000}).prompt == "x" * 100_000


def test_a_large_constraint_is_checked_in_the_process(parser):
    # the 1 MB schema is refused by its size there; a valid one comes back with its constraint already computed
    wide = {"type": "object", "properties": {f"f{i:05d}": {"type": "string", "description": "d" * 100}
                                             for i in range(8000)}}  # fmt: skip
    with pytest.raises(APIError) as refused:
        parse(parser, {"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"schema": wide}}})
    assert (refused.value.status, refused.value.param) == (400, "response_format")
    assert f"more than the {MAX_CONSTRAINT_BYTES}" in refused.value.message
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}}
    request = parse(parser, {"prompt": "y" * 100_000, "response_format": {"type": "json_schema",
                                                                       "json_schema": {"schema": schema}}})  # fmt: skip
    assert request._constraint is not None and request._constraint[0].source == "response_format"
    assert request.constraint() is request._constraint[0]


SERVER_STAND_IN = """
import sys, time
from batchserve.entrypoints.openai.bodies import BodyParser
if __name__ == "__main__":
    print(BodyParser().start().result(timeout=120), flush=True)
    time.sleep(120)
"""


def test_the_parser_process_exits_when_the_server_is_killed(tmp_path):
    # a killed server cannot shut its pool down: the parser must notice by itself, not wait for bodies forever
    script = tmp_path / "server.py"
    script.write_text(SERVER_STAND_IN)
    server = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    try:
        child = int(server.stdout.readline())
        server.kill()
        server.wait(30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(child):
            time.sleep(0.1)
        assert not _alive(child)
    finally:
        server.kill()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:  # a zombie (exited, not yet reaped by init) is not running
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_a_server_spawns_the_parser_with_its_first_large_body():
    """As `batchserve serve` sets it up: no process until a large body comes; that one is parsed on a thread (the
    same answer) while the process starts, and later ones go to the process."""
    lazy = BodyParser()
    lazy.start_on_first_body()
    try:
        assert not lazy.in_process and lazy._pool is None
        first = parse(lazy, {"prompt": "a", "max_tokens": 2})
        assert first.max_tokens == 2 and lazy._pool is not None  # spawned by that body
        lazy.start().result(timeout=120)
        assert lazy.in_process
    finally:
        lazy.close()


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_a_body_refused_before_costs_the_parser_process_nothing(parser):
    # measured work, not time: the first parse of a 100k-entry logit_bias (an escape after it: the scan of
    # bounded fields leaves it to the parse) takes the process tens of milliseconds of CPU; ten more sends of the
    # same bytes are answered from memory and take it none
    body = json.dumps({"prompt": "z", "logit_bias": {str(i): 3 for i in range(100_000)}, "user": "\u00e9"}).encode()
    child, hits = parser.start().result(), parser.refused.hits

    def refused() -> APIError:
        with pytest.raises(APIError) as error:
            asyncio.run(parser.parse(body, CompletionRequest, False))
        return error.value

    before = _cpu_s(child)
    first = refused()
    parsed = _cpu_s(child)
    again = [refused() for _ in range(10)]
    assert parsed - before >= 0.01  # the one parse, in the process
    assert _cpu_s(child) - parsed <= 0.02 and parser.refused.hits - hits == 10
    assert all((e.status, e.param, e.message) == (400, "logit_bias", first.message) for e in [first, *again])


def test_huge_logit_bias_bodies_that_differ_are_refused_from_a_scan_in_the_process(parser):
    # ten different 100k-entry bodies: parsed, they would take the process 0.3 s of CPU or more
    bodies = [json.dumps({"prompt": "z", "logit_bias": {str(i): n for i in range(100_000)}}).encode()
              for n in range(10)]  # fmt: skip
    child = parser.start().result()
    before = _cpu_s(child)
    for body in bodies:
        with pytest.raises(APIError) as refused:
            asyncio.run(parser.parse(body, CompletionRequest, False))
        assert (refused.value.status, refused.value.param) == (400, "logit_bias")
    assert _cpu_s(child) - before <= 0.1


def test_the_parser_process_is_lowered_before_its_imports_run():
    # its start (an interpreter importing pydantic and the request models) is most of its CPU: lowered from the
    # moment it exists, not from its initializer on
    process = NicedSpawnContext().Process(target=time.sleep, args=(30,))
    process.start()
    try:
        assert os.getpriority(os.PRIO_PROCESS, process.pid) == min(19, os.getpriority(os.PRIO_PROCESS, 0) + PARSER_NICE)
    finally:
        process.kill()
        process.join()
