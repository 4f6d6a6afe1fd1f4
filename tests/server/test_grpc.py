"""The gRPC front end's native service (batchserve.v1.Generation) on the model-free engine, sharing one engine with
the HTTP server as `batchserve serve --grpc-port` does: results equal the OpenAI endpoint's, streams concatenate to
the unary result, cancels and aborts free every block, bad input is INVALID_ARGUMENT, a full queue is
RESOURCE_EXHAUSTED, the API key, health, reflection, and a drain on stop."""

from __future__ import annotations

import threading
import time

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from batchserve.engine.async_engine import AsyncLLMEngine
from batchserve.entrypoints.grpc.pb import generation_pb2 as pb
from tests.server.fakes import fake_engine
from tests.server.grpc_live import LiveGrpc
from tests.server.live import start_server

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def servers():
    http = start_server(fake_engine(delay_s=0.002), served_model_name=["fake"])
    live = LiveGrpc(http.async_engine, ["fake"], max_request_bytes=64 * 1024)
    yield http, live
    live.stop()
    http.stop()


def generate(live: LiveGrpc, **fields) -> list[pb.GenerateResponse]:
    sampling = fields.pop("sampling", {})
    return list(
        live.generation.Generate(pb.GenerateRequest(sampling=pb.SamplingParams(**sampling), **fields), timeout=30)
    )


def blocks_used(http) -> float:
    http.wait_idle()
    return http.async_engine.stats().kv_blocks_used


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as info:
        call()
    return info.value.code(), info.value.details()


def test_greedy_text_equals_the_openai_endpoint(servers):
    http, live = servers
    body = {"model": "fake", "prompt": PROMPT, "max_tokens": 12, "temperature": 0}
    expected = httpx.post(http.url + "/v1/completions", json=body, timeout=30).json()
    (reply,) = generate(live, text=PROMPT, sampling={"max_tokens": 12, "temperature": 0}, return_text=True)
    assert reply.text == expected["choices"][0]["text"] and len(reply.token_ids) == 12
    assert reply.finish_reason == "length"
    usage = expected["usage"]
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (usage["prompt_tokens"], 12)
    ids = httpx.post(http.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    (by_ids,) = generate(live, tokens=pb.TokenIds(ids=ids), sampling={"max_tokens": 12, "temperature": 0})
    assert list(by_ids.token_ids) == list(reply.token_ids) and by_ids.text == ""  # text only when asked


def test_stream_concatenates_to_the_unary_result(servers):
    _, live = servers
    fields = {"text": PROMPT, "sampling": {"max_tokens": 10, "temperature": 0}, "return_text": True}
    (whole,) = generate(live, **fields)
    parts = generate(live, stream=True, **fields)
    assert len(parts) == 10  # one message per step
    assert [t for p in parts for t in p.token_ids] == list(whole.token_ids)
    assert "".join(p.text for p in parts) == whole.text
    assert all(not p.finish_reason and not p.HasField("usage") for p in parts[:-1])
    assert parts[-1].finish_reason == "length" and parts[-1].usage.completion_tokens == 10


def test_stop_string_and_stop_token(servers):
    _, live = servers
    (whole,) = generate(live, text=PROMPT, sampling={"max_tokens": 12, "temperature": 0}, return_text=True)
    stop = whole.text[4:6]
    (cut,) = generate(
        live, text=PROMPT, sampling={"max_tokens": 12, "temperature": 0, "stop": [stop]}, return_text=True
    )
    assert cut.text == whole.text[: whole.text.index(stop)] and cut.stop_string == stop
    ids = list(whole.token_ids)
    token = ids[3]
    (by_token,) = generate(live, text=PROMPT, sampling={"max_tokens": 12, "temperature": 0, "stop_token_ids": [token]})
    assert list(by_token.token_ids) == ids[: ids.index(token) + 1]
    assert by_token.stop_token_id == token and by_token.finish_reason == "stop"


def test_a_cancelled_stream_frees_every_block(servers):
    http, live = servers
    idle = http.async_engine.stats().kv_blocks_total
    call = live.generation.Generate(pb.GenerateRequest(
        text=PROMPT * 8, stream=True, sampling=pb.SamplingParams(max_tokens=200, ignore_eos=True)))  # fmt: skip
    next(call), next(call)
    assert http.async_engine.stats().kv_blocks_used > 0
    call.cancel()
    assert blocks_used(http) == 0
    assert http.async_engine.stats().kv_blocks_free == idle


def test_abort_by_request_id(servers):
    http, live = servers
    request = pb.GenerateRequest(request_id="abort-me", text=PROMPT, stream=True,
                                 sampling=pb.SamplingParams(max_tokens=200, ignore_eos=True))  # fmt: skip
    call = live.generation.Generate(request, timeout=30)
    first = next(call)
    assert live.generation.Abort(pb.AbortRequest(request_ids=["abort-me", "unknown"])).aborted_ids == ["abort-me"]
    rest = list(call)
    assert rest[-1].finish_reason == "abort" and rest[-1].usage.completion_tokens >= len(first.token_ids)
    assert blocks_used(http) == 0


def test_n_choices_unary_and_streamed_agree_and_abort_ends_them_all(servers):
    http, live = servers
    sampling = {"max_tokens": 6, "temperature": 1.0, "seed": 7, "n": 3}
    unary = generate(live, text=PROMPT, sampling=sampling)
    assert sorted(r.index for r in unary) == [0, 1, 2] and all(r.finish_reason == "length" for r in unary)
    streamed: dict[int, list[int]] = {0: [], 1: [], 2: []}
    for reply in generate(live, text=PROMPT, sampling=sampling, stream=True):
        streamed[reply.index] += reply.token_ids
    assert streamed == {r.index: list(r.token_ids) for r in unary}
    request = pb.GenerateRequest(request_id="abort-n", text=PROMPT, stream=True,
                                 sampling=pb.SamplingParams(max_tokens=200, ignore_eos=True, n=2))  # fmt: skip
    call = live.generation.Generate(request, timeout=30)
    next(call)
    assert live.generation.Abort(pb.AbortRequest(request_ids=["abort-n"])).aborted_ids == ["abort-n"]
    assert list(call)[-1].finish_reason == "abort"
    assert blocks_used(http) == 0


BAD = [
    ({}, "input"),
    ({"text": ""}, "empty"),
    ({"tokens": pb.TokenIds(ids=[1, 100_000])}, "tokens"),
    ({"tokens": pb.TokenIds(ids=[-1])}, "tokens"),
    ({"text": "x", "sampling": {"max_tokens": 0}}, "max_tokens"),
    ({"text": "x", "sampling": {"temperature": -1}}, "temperature"),
    ({"text": "x", "sampling": {"temperature": float("nan")}}, "temperature"),
    ({"text": "x", "sampling": {"top_p": 0}}, "top_p"),
    ({"text": "x", "sampling": {"top_k": -2}}, "top_k"),
    ({"text": "x", "sampling": {"logprobs": 21}}, "logprobs"),
    ({"text": "x", "sampling": {"n": 0}}, "n"),
    ({"text": "x", "sampling": {"max_tokens": 4, "min_tokens": 5}}, "min_tokens"),
    ({"text": "x", "sampling": {"stop": [""]}}, "stop"),
    ({"text": "x", "sampling": {"stop": ["s"] * 33}}, "stop"),
    ({"text": "x", "sampling": {"stop_token_ids": [-3]}}, "stop_token_ids"),
    ({"text": "x" * 300}, "max_input_len"),
    ({"tokens": pb.TokenIds(ids=[1] * 300)}, "max_input_len"),
    ({"text": "x", "sampling": {"max_tokens": 300}}, None),  # prompt + output over max_model_len: served, cut
]


@pytest.mark.parametrize("fields,needle", BAD[:-1])
def test_bad_input_is_invalid_argument_and_the_server_keeps_serving(servers, fields, needle):
    _, live = servers
    code, details = code_of(lambda: generate(live, **fields))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and needle in details, details
    (ok,) = generate(live, text="hi", sampling={"max_tokens": 2})
    assert len(ok.token_ids) == 2


def test_size_limit_and_a_request_id_in_use(servers):
    http, live = servers
    code, _ = code_of(lambda: generate(live, text="y" * 100_000))  # over max_request_bytes
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
    request = pb.GenerateRequest(request_id="twice", text="a", stream=True,
                                 sampling=pb.SamplingParams(max_tokens=100, ignore_eos=True))  # fmt: skip
    call = live.generation.Generate(request, timeout=30)
    next(call)
    code, details = code_of(lambda: generate(live, request_id="twice", text="b"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "in use" in details
    call.cancel()
    assert blocks_used(http) == 0


def test_model_and_server_info(servers):
    _, live = servers
    info = live.generation.ModelInfo(pb.ModelInfoRequest())
    assert info.model_name == "fake" and info.max_model_len == 256 and info.block_size == 16
    assert info.num_kv_blocks == 256 and info.max_batch_size == 8 and info.vocab_size > 256
    assert info.max_request_bytes == 64 * 1024 and info.truncation == "error"
    status = live.generation.ServerInfo(pb.ServerInfoRequest())
    assert status.engine_running and status.kv_blocks_total == 256 and status.uptime_s > 0


def test_health_and_reflection(servers):
    _, live = servers
    health = health_pb2_grpc.HealthStub(live.channel)
    for service in ("", "batchserve.v1.Generation", "inference.GRPCInferenceService"):
        reply = health.Check(health_pb2.HealthCheckRequest(service=service))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(live.channel)
    (answer,) = reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
    names = {s.name for s in answer.list_services_response.service}
    assert {"batchserve.v1.Generation", "inference.GRPCInferenceService", "grpc.health.v1.Health"} <= names
    ask = reflection_pb2.ServerReflectionRequest(file_containing_symbol="inference.ModelInferRequest")
    (files,) = reflection.ServerReflectionInfo(iter([ask]))
    assert files.file_descriptor_response.file_descriptor_proto  # grpcurl can describe the KServe messages


def test_api_key():
    engine = AsyncLLMEngine(fake_engine())
    live = LiveGrpc(engine, ["fake"], api_key="sekret")
    try:
        request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2))
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            code, _ = code_of(lambda m=metadata: list(live.generation.Generate(request, metadata=m)))
            assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = code_of(lambda: live.generation.ModelInfo(pb.ModelInfoRequest()))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        (ok,) = live.generation.Generate(request, metadata=(("authorization", "Bearer sekret"),))
        assert len(ok.token_ids) == 2
        health = health_pb2_grpc.HealthStub(live.channel).Check(health_pb2.HealthCheckRequest())
        assert health.status == health_pb2.HealthCheckResponse.SERVING  # open, as the HTTP /health
    finally:
        live.stop()
        engine.shutdown()


def test_a_full_queue_is_resource_exhausted():
    engine = AsyncLLMEngine(fake_engine(delay_s=0.01, max_batch_size=1, max_waiting_requests=1))
    live = LiveGrpc(engine, ["fake"])
    try:
        long = pb.GenerateRequest(text="a", stream=True, sampling=pb.SamplingParams(max_tokens=300, ignore_eos=True))
        running = live.generation.Generate(long, timeout=30)
        next(running)
        waiting = live.generation.Generate(long, timeout=30)
        deadline = time.monotonic() + 10
        while engine.stats().num_waiting < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        with pytest.raises(grpc.RpcError) as info:
            list(live.generation.Generate(pb.GenerateRequest(text="b"), timeout=30))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert dict(info.value.trailing_metadata())["retry-after"] == "1"
        running.cancel()
        waiting.cancel()
        assert engine.wait_idle(30) and engine.stats().kv_blocks_used == 0
    finally:
        live.stop()
        engine.shutdown()


def test_stop_drains_streams_in_flight():
    engine = AsyncLLMEngine(fake_engine(delay_s=0.01))
    live = LiveGrpc(engine, ["fake"])
    try:
        request = pb.GenerateRequest(text="a", stream=True, sampling=pb.SamplingParams(max_tokens=60, ignore_eos=True))
        call = live.generation.Generate(request, timeout=30)
        first = next(call)
        stopping = threading.Thread(target=lambda: live._run(live.server.stop(grace=20)))
        stopping.start()
        rest = list(call)  # finishes within the grace period
        assert len(first.token_ids) + sum(len(r.token_ids) for r in rest) == 60 and rest[-1].finish_reason == "length"
        stopping.join(30)
        code, _ = code_of(lambda: list(live.generation.Generate(request, timeout=5)))
        assert code == grpc.StatusCode.UNAVAILABLE  # stopped: refused
    finally:
        live.loop.call_soon_threadsafe(live.loop.stop)
        live.thread.join(30)
        engine.shutdown()
