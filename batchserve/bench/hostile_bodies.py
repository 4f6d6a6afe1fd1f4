"""The hostile request bodies the reliability probes send (benchmarks/hostile.py beside a stream, the soak mixed into
its load): each one a server must refuse with a 4xx, or serve within bounded work, and keep serving."""

from __future__ import annotations

import asyncio
import json
from typing import Any

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def wide_schema(properties: int = 8000) -> dict[str, Any]:
    """A JSON schema of `properties` required string properties with descriptions: about 1 MB."""
    names = [f"field_{i:05d}" for i in range(properties)]
    return {"type": "object", "properties": {name: {"type": "string", "description": "d" * 100} for name in names},
            "required": names}  # fmt: skip


def nested(depth: int, leaf: Any = "x") -> Any:
    value: Any = leaf
    for _ in range(depth):
        value = [value]
    return value


def nested_schema(depth: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    return schema


def _chat(**fields: Any) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": "x"}], "max_tokens": 4, **fields}


# (path, body): what the hostile.py TPOT round loops beside a stream
HOSTILE_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "logit_bias_100k": (COMPLETIONS, {"prompt": "x", "max_tokens": 4,
                                      "logit_bias": {str(i): 1 for i in range(100_000)}}),
    "stop_ids_590k": (COMPLETIONS, {"prompt": "x", "max_tokens": 4, "stop_token_ids": list(range(590_000))}),
    "json_schema_8000": (CHAT, _chat(response_format={"type": "json_schema",
                                                      "json_schema": {"name": "wide", "schema": wide_schema()}})),
    "echo_scoring_7k": (COMPLETIONS, {"prompt": "hello " * 7000, "max_tokens": 0, "echo": True, "logprobs": 5}),
    "nesting_200": (COMPLETIONS, {"prompt": nested(200), "max_tokens": 4}),
}  # fmt: skip

# the rest of the reliability issue's edges, for the soak's mix
EDGE_BODIES: dict[str, tuple[str, dict[str, Any]]] = {
    "prompt_logprobs_7k": (COMPLETIONS, {"prompt": "hello " * 7000, "max_tokens": 1, "prompt_logprobs": 20}),
    "schema_nested_200": (CHAT, _chat(response_format={"type": "json_schema",
                                                       "json_schema": {"name": "deep", "schema": nested_schema(200)}})),
    "echo_scoring_900": (COMPLETIONS, {"prompt": "hello " * 900, "max_tokens": 0, "echo": True, "logprobs": 5}),
    "oov_stop_token_ids": (COMPLETIONS, {"prompt": "x", "max_tokens": 4, "stop_token_ids": [10**9, -5]}),
    "temperature_negative": (COMPLETIONS, {"prompt": "x", "max_tokens": 4, "temperature": -1}),
    "message_without_content": (CHAT, {"messages": [{"role": "user"}], "max_tokens": 4}),
    "tool_message_without_id": (CHAT, {"messages": [{"role": "tool", "content": "x"}], "max_tokens": 4}),
    "kserve_end_id_oov": ("/v2/models/ensemble/generate", {"text_input": "x", "max_tokens": 2, "end_id": 10**9}),
}  # fmt: skip

# raw bodies json.dumps cannot write (a lone surrogate escaped in the JSON text)
RAW_EDGE_BODIES: dict[str, tuple[str, bytes]] = {
    "kserve_lone_surrogate": ("/v2/models/ensemble/generate", b'{"text_input": "\\ud800", "max_tokens": 2}'),
    "kserve_infer_lone_surrogate": ("/v2/models/ensemble/infer", b'{"inputs": [{"name": "text_input", "shape": [1], '
                                    b'"datatype": "BYTES", "data": ["\\ud800"]}, {"name": "max_tokens", "shape": [1], '
                                    b'"datatype": "INT32", "data": [2]}]}'),
}  # fmt: skip


def soak_mix() -> list[tuple[str, str, bytes]]:
    """(name, path, raw body) of every hostile body above, encoded once."""
    mix = [(name, path, json.dumps(body).encode()) for name, (path, body) in {**HOSTILE_BODIES, **EDGE_BODIES}.items()]
    return mix + [(name, path, raw) for name, (path, raw) in RAW_EDGE_BODIES.items()]


async def slow_body(host: str, port: int, byte_every_s: float = 0.5, limit_s: float = 300.0) -> int:
    """Headers promising a 1,000-byte body, then a byte every `byte_every_s` until the server answers or closes:
    the status it answered (408 from --body-read-timeout), 0 if it closed without one."""
    reader, writer = await asyncio.open_connection(host, port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 1000\r\n\r\n{")  # fmt: skip
    answer = b""
    try:
        async with asyncio.timeout(limit_s):
            while not reader.at_eof():
                try:
                    answer += await asyncio.wait_for(reader.read(4096), byte_every_s)
                except TimeoutError:
                    writer.write(b" ")
                    await writer.drain()
                if answer.startswith(b"HTTP/1.1 ") and len(answer) >= 12:
                    break
    except (ConnectionError, TimeoutError):
        pass
    finally:
        writer.close()
    return int(answer[9:12]) if answer.startswith(b"HTTP/1.1 ") and len(answer) >= 12 else 0
