"""Every edge a hostile client found is a 4xx on every front end (OpenAI, KServe HTTP infer and generate) and the
same exception offline: nesting too deep for the checks that recurse, lone surrogates, token ids outside the
vocabulary, sampling values out of range whatever the decoding mode, chat messages of the wrong shape, and
constraints that do not compile."""

from __future__ import annotations

import json
import math

import httpx
import pytest

from batchserve.entrypoints.llm import LLM
from batchserve.sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams
from tests.server.fakes import fake_engine
from tests.server.live import start_server

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/v2/models/fake/generate"
INFER = "/v2/models/fake/infer"


@pytest.fixture(scope="module")
def server():
    s = start_server(fake_engine(delay_s=0.001), served_model_name=["fake"])
    yield s
    s.stop()


def post(server, path, body=None, **kwargs):
    return httpx.post(server.url + path, json=body, timeout=60, **kwargs)


def refused(response, status=400) -> str:
    """The error message of a refusal (OpenAI's {"error": {...}} or KServe's {"error": "..."})."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    return error["message"] if isinstance(error, dict) else error


def nested_schema(depth: int) -> dict:
    schema: dict = {"type": "string"}
    for _ in range(depth):
        schema = {"type": "object", "properties": {"a": schema}}
    return schema


def still_serves(server) -> None:
    ok = post(server, COMPLETIONS, {"prompt": "abc", "max_tokens": 2})
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2


# ------------------------------------------------------------------------------------------------ deep schemas
@pytest.mark.parametrize(
    ("path", "body"),
    [
        (CHAT, {"messages": [{"role": "user", "content": "hi"}],
                "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": nested_schema(200)}}}),
        (COMPLETIONS, {"prompt": "hi", "guided_json": nested_schema(200)}),
        (COMPLETIONS, {"prompt": "hi", "guided_json": json.dumps(nested_schema(200))}),
        (COMPLETIONS, {"prompt": "hi", "structured_outputs": {"json": {"anyOf": [nested_schema(150)]}}}),
        (GENERATE, {"text_input": "hi", "max_tokens": 2, "guided_decoding_guide_type": "json_schema",
                    "guided_decoding_guide": json.dumps(nested_schema(200))}),
        (GENERATE, {"text_input": "hi", "max_tokens": 2, "guided_decoding_guide_type": "json_schema",
                    "guided_decoding_guide": "[" * 100_000 + "]" * 100_000}),
    ],
)  # fmt: skip
def test_a_schema_nested_200_deep_is_a_400_before_anything_recurses(server, path, body):
    assert "nests deeper than" in refused(post(server, path, body))
    still_serves(server)


def test_a_kserve_infer_body_nested_too_deep_is_a_400(server):
    body = b'{"inputs": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"
    assert "nested too deeply" in refused(httpx.post(server.url + INFER, content=body, timeout=60))


# ------------------------------------------------------------------------------------------------ lone surrogates
def infer_body(text: str, **scalars: tuple[str, object]) -> dict:
    inputs = [{"name": "text_input", "datatype": "BYTES", "shape": [1, 1], "data": [text]},
              {"name": "max_tokens", "datatype": "INT32", "shape": [1, 1], "data": [2]}]  # fmt: skip
    for name, (datatype, value) in scalars.items():
        inputs.append({"name": name, "datatype": datatype, "shape": [1, 1], "data": [value]})
    return {"inputs": inputs}


def test_a_lone_surrogate_in_kserve_infer_text_input_is_a_400(server):
    # JSON's \ud800 escape decodes to a lone surrogate, which no tokenizer can encode (it was a 500)
    raw = json.dumps(infer_body("a \ud800 b")).encode()
    assert b"\\ud800" in raw
    assert "lone surrogate" in refused(httpx.post(server.url + INFER, content=raw, timeout=60))
    raw = json.dumps({"text_input": "\udfff", "max_tokens": 2}).encode()
    assert "lone surrogate" in refused(httpx.post(server.url + GENERATE, content=raw, timeout=60))
    raw = json.dumps(infer_body("fine", stop_words=("BYTES", "\ud800"))).encode()
    assert "lone surrogate" in refused(httpx.post(server.url + INFER, content=raw, timeout=60))
    still_serves(server)


# ------------------------------------------------------------------------------------------------ token ids
@pytest.mark.parametrize("token_id", [10**9, -5])
def test_out_of_vocabulary_token_ids_are_a_400(server, token_id):
    for path, body in [
        (COMPLETIONS, {"prompt": "a", "max_tokens": 2, "stop_token_ids": [token_id]}),
        (CHAT, {"messages": [{"role": "user", "content": "a"}], "max_tokens": 2, "stop_token_ids": [token_id]}),
        (COMPLETIONS, {"prompt": "a", "max_tokens": 2, "logit_bias": {str(token_id): 1}}),
        (GENERATE, {"text_input": "a", "max_tokens": 2, "end_id": token_id}),
        (INFER, infer_body("a", end_id=("INT32", token_id))),
    ]:
        message = refused(post(server, path, body))
        assert any(name in message for name in ("stop_token_ids", "end_id", "logit_bias")), message
    never_stop = post(server, GENERATE, {"text_input": "a", "max_tokens": 3, "end_id": -1})  # -1 stays allowed
    assert never_stop.status_code == 200, never_stop.text


# ------------------------------------------------------------------------------------------------ sampling values
@pytest.mark.parametrize("temperature", [-1.0, float("nan"), 1e9])
def test_a_bad_temperature_is_a_400_even_on_a_greedy_kserve_request(server, temperature):
    # neither top_k nor top_p: TensorRT-LLM's greedy decoding, where the temperature is not used (it was accepted)
    raw = json.dumps({"text_input": "a", "max_tokens": 2, "temperature": temperature}).encode()
    expect = "NaN" if math.isnan(temperature) else "temperature"  # the generate route's JSON parser refuses NaN
    assert expect in refused(httpx.post(server.url + GENERATE, content=raw, timeout=60))
    raw = json.dumps(infer_body("a", temperature=("FP32", temperature))).encode()
    assert "temperature" in refused(httpx.post(server.url + INFER, content=raw, timeout=60))
    if not math.isnan(temperature):
        assert "temperature" in refused(post(server, COMPLETIONS, {"prompt": "a", "temperature": temperature}))


def test_greedy_kserve_requests_with_good_values_are_served(server):
    body = {"text_input": "a", "max_tokens": 2, "temperature": 0.7}
    assert post(server, GENERATE, body).status_code == 200
    assert "top_k" in refused(post(server, GENERATE, {**body, "top_k": -3}))
    assert "top_p" in refused(post(server, GENERATE, {**body, "top_p": 1.5}))


# ------------------------------------------------------------------------------------------------ chat shapes
@pytest.mark.parametrize(
    ("messages", "expect"),
    [
        ([{"role": "user"}], "needs 'content'"),
        ([{"role": "user", "content": None}], "needs 'content'"),
        ([{"role": "system", "content": None}, {"role": "user", "content": "x"}], "needs 'content'"),
        ([{"role": "user", "content": "x"}, {"role": "assistant"}], "needs 'content' (or tool_calls)"),
        ([{"role": "user", "content": "x"},
          {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function",
                                                                 "function": {"name": "f", "arguments": "{}"}}]},
          {"role": "tool", "content": "sunny"}], "tool_call_id"),
    ],
)  # fmt: skip
def test_chat_messages_of_the_wrong_shape_are_a_400(server, make_llm, messages, expect):
    assert expect in refused(post(server, CHAT, {"messages": messages, "max_tokens": 2}))
    with pytest.raises(InvalidRequestError, match=expect.replace("(", r"\(").replace(")", r"\)")):
        make_llm().chat(messages, use_tqdm=False)


def test_an_assistant_turn_of_tool_calls_needs_no_content(server):
    messages = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
    ]  # fmt: skip
    assert post(server, CHAT, {"messages": messages, "max_tokens": 2}).status_code == 200


# ------------------------------------------------------------------------------------------------ offline
@pytest.fixture
def make_llm(make_engine):
    return lambda: LLM.from_engine(make_engine())


@pytest.mark.parametrize(
    ("call", "param", "message"),
    [
        (lambda llm: llm.generate("a \ud800"), "prompt", "lone surrogate"),
        (lambda llm: llm.generate({"prompt": "\udc00"}), "prompt", "lone surrogate"),
        (lambda llm: llm.chat([{"role": "user", "content": "\ud800"}]), "messages", "lone surrogate"),
        (lambda llm: llm.generate("a", SamplingParams(stop=["\ud800"])), "stop", "lone surrogate"),
        (lambda llm: llm.generate("a", SamplingParams(structured_outputs="nope")), "structured_outputs", "got str"),
        (lambda llm: llm.generate("a", SamplingParams(stop_token_ids=[10**9])), "stop_token_ids", "stop_token_ids"),
        (lambda llm: llm.generate("a", SamplingParams(logit_bias={10**9: 1.0})), "logit_bias", "logit_bias"),
        (lambda llm: StructuredOutputsParams("yaml", "x"), "structured_outputs", "kind must be one of"),
        (lambda llm: llm.generate("a", SamplingParams(structured_outputs=StructuredOutputsParams("json", "{not json"))),
         "structured_outputs", "not valid JSON"),
        (lambda llm: llm.generate("a", SamplingParams(structured_outputs=StructuredOutputsParams(
            "json", json.dumps(nested_schema(200))))), "structured_outputs", "nests deeper"),
        (lambda llm: llm.generate("a", SamplingParams(structured_outputs=StructuredOutputsParams(
            "json", '{"type": "object", "frobnicate": 1}'))), "structured_outputs", "frobnicate"),
        (lambda llm: llm.generate("a", SamplingParams(structured_outputs=StructuredOutputsParams("regex", "a(b"))),
         "structured_outputs", "invalid regex"),
    ],
)  # fmt: skip
def test_offline_raises_what_http_answers_400_and_leaves_nothing_behind(make_llm, call, param, message):
    llm = make_llm()
    with pytest.raises(InvalidRequestError, match=message) as error:
        call(llm)
    assert error.value.param == param
    assert not llm.engine.has_unfinished_requests()
    (out,) = llm.generate(["abc"], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True), use_tqdm=False)
    assert len(out.token_ids) == 3


# ------------------------------------------------------------------------------------------------ gRPC
def test_grpc_messages_that_cannot_be_decoded_or_hold_bad_values_are_invalid_argument():
    import grpc

    from batchserve.engine.async_engine import AsyncLLMEngine
    from batchserve.entrypoints.grpc.pb import generation_pb2 as pb
    from tests.server.grpc_live import LiveGrpc

    engine = AsyncLLMEngine(fake_engine(delay_s=0.001))
    live = LiveGrpc(engine, ["fake"])
    try:
        raw = live.channel.unary_stream("/batchserve.v1.Generation/Generate", request_serializer=lambda b: b,
                                        response_deserializer=lambda b: b)  # fmt: skip
        text_field = pb.GenerateRequest.DESCRIPTOR.fields_by_name["text"].number
        for body in (bytes([text_field << 3 | 2, 3]) + b"\xed\xa0\x80", b"\x12\x7f"):  # a surrogate's bytes; truncated
            with pytest.raises(grpc.RpcError) as error:
                list(raw(body, timeout=30))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()  # was INTERNAL
        for request in (
            pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2, stop_token_ids=[10**9])),
            pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(
                max_tokens=2, json_schema=json.dumps(nested_schema(200)))),
        ):  # fmt: skip
            with pytest.raises(grpc.RpcError) as error:
                list(live.generation.Generate(request, timeout=30))
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
        (ok,) = live.generation.Generate(pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2)))
        assert len(ok.token_ids) == 2
    finally:
        live.stop()
        engine.shutdown()
