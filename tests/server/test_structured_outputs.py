"""Structured outputs end to end on SmolLM2-135M-Instruct: the official openai client against a live server."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow

ASK_JSON = [{"role": "user", "content": "Describe a city as JSON."}]


class City(BaseModel):
    name: str = Field(max_length=16)
    population: int = Field(ge=0, le=10_000_000)
    coastal: bool


def test_parse_with_a_pydantic_model_returns_a_parsed_object(real_server, client):
    completion = client.chat.completions.parse(
        model=real_server.model_id(), messages=ASK_JSON, response_format=City, max_tokens=64, temperature=0
    )
    city = completion.choices[0].message.parsed
    assert isinstance(city, City)
    assert completion.choices[0].finish_reason == "stop"


def test_streamed_json_schema_equals_non_streamed_and_validates(real_server, client):
    schema = {"type": "object", "properties": {"tags": {"type": "array", "items": {"enum": ["a", "b"]},
              "minItems": 1, "maxItems": 3}}, "required": ["tags"], "additionalProperties": False}  # fmt: skip
    response_format = {"type": "json_schema", "json_schema": {"name": "t", "schema": schema, "strict": True}}
    args = dict(model=real_server.model_id(), messages=ASK_JSON, max_tokens=40, temperature=0,
                response_format=response_format)  # fmt: skip
    full = client.chat.completions.create(**args).choices[0].message.content
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **args)
                       if c.choices)  # fmt: skip
    assert streamed == full
    assert 1 <= len(json.loads(full)["tags"]) <= 3


def test_json_object_in_chat_and_completions(real_server, client):
    model = real_server.model_id()
    chat = client.chat.completions.create(model=model, messages=ASK_JSON, max_tokens=48, temperature=0,
                                          response_format={"type": "json_object"})  # fmt: skip
    assert isinstance(json.loads(chat.choices[0].message.content), dict)
    completion = client.completions.create(model=model, prompt="A JSON object:", max_tokens=48, temperature=0,
                                           extra_body={"response_format": {"type": "json_object"}})  # fmt: skip
    assert isinstance(json.loads(completion.choices[0].text), dict)


@pytest.mark.parametrize(
    "extra, check",
    [
        ({"guided_regex": "[0-9]{3}-[a-z]{2}"}, lambda t: re.fullmatch("[0-9]{3}-[a-z]{2}", t)),
        ({"guided_choice": ["sunny", "rainy"]}, lambda t: t in ("sunny", "rainy")),
        ({"guided_grammar": 'root ::= "x" ("y" | "z")'}, lambda t: t in ("xy", "xz")),
        ({"guided_json": {"type": "integer", "minimum": 3, "maximum": 7}}, lambda t: 3 <= int(t) <= 7),
        ({"structured_outputs": {"choice": ["up", "down"]}}, lambda t: t in ("up", "down")),
        ({"structured_outputs": {"regex": "(ab){1,3}"}}, lambda t: re.fullmatch("(ab){1,3}", t)),
    ],
)
def test_vllm_guided_fields_on_completions(real_server, client, extra, check):
    out = client.completions.create(model=real_server.model_id(), prompt="The weather today:", max_tokens=12,
                                    temperature=1.0, seed=1, extra_body=extra)  # fmt: skip
    assert check(out.choices[0].text), out.choices[0].text
    assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"guided_regex": "(ab"}, "guided_regex"),
        ({"guided_grammar": "root ::= "}, "guided_grammar"),
        ({"guided_json": {"type": "nonsense"}}, "guided_json"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a+", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"whitespace_pattern": " "}}, "structured_outputs"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_its_field_and_the_server_carries_on(real_server, extra, param):
    body = {"prompt": "x", "max_tokens": 4, **extra}
    response = httpx.post(real_server.url + "/v1/completions", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
    ok = httpx.post(real_server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200


def test_constraints_through_the_native_grpc_service(real_server):
    import grpc

    from batchserve.entrypoints.grpc.pb import generation_pb2 as pb
    from tests.server.grpc_live import LiveGrpc

    live = LiveGrpc(real_server.async_engine, [real_server.model_id()])
    try:
        schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
                  "required": ["n"], "additionalProperties": False}  # fmt: skip
        cases = [
            (pb.SamplingParams(max_tokens=24, temperature=0, json_schema=json.dumps(schema)),
             lambda text: 0 <= json.loads(text)["n"] <= 9),
            (pb.SamplingParams(max_tokens=8, temperature=1, seed=3, choice=pb.Choices(values=["yes", "no"])),
             lambda text: text in ("yes", "no")),
            (pb.SamplingParams(max_tokens=12, temperature=0, regex="[0-9]{3}-[a-z]{2}"),
             lambda text: re.fullmatch("[0-9]{3}-[a-z]{2}", text)),
        ]  # fmt: skip
        for sampling, check in cases:
            request = pb.GenerateRequest(text="Answer:", sampling=sampling, return_text=True)
            (reply,) = live.generation.Generate(request, timeout=120)
            assert check(reply.text) and reply.finish_reason == "stop", (sampling, reply.text)
        bad = pb.GenerateRequest(text="Answer:", sampling=pb.SamplingParams(max_tokens=4, regex="(unclosed"))
        with pytest.raises(grpc.RpcError) as info:
            list(live.generation.Generate(bad, timeout=60))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "sampling.regex" in info.value.details()
    finally:
        live.stop()


def test_tensorrt_llm_guided_decoding_inputs_on_the_kserve_generate_endpoint(real_server):
    url = f"{real_server.url}/v2/models/{real_server.model_id()}/generate"
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    body = {"text_input": "Reply in JSON:", "max_tokens": 24, "guided_decoding_guide_type": "json_schema",
            "guided_decoding_guide": json.dumps(schema)}  # fmt: skip
    reply = httpx.post(url, json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    assert isinstance(json.loads(reply.json()["text_output"])["ok"], bool)
    body = {"text_input": "Pick:", "max_tokens": 8, "guided_decoding_guide_type": "regex",
            "guided_decoding_guide": "(red|green)"}  # fmt: skip
    assert httpx.post(url, json=body, timeout=120).json()["text_output"] in ("red", "green")
    for wrong, field in (({"guided_decoding_guide_type": "structural_tag", "guided_decoding_guide": "{}"},
                          "guided_decoding_guide_type"), ({"guided_decoding_guide_type": "regex"},
                          "guided_decoding_guide")):  # fmt: skip
        reply = httpx.post(url, json={"text_input": "x", "max_tokens": 4, **wrong}, timeout=60)
        assert reply.status_code == 400 and field in reply.text, reply.text
