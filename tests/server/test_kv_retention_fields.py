"""The kv_retention request field over HTTP and gRPC: accepted in TensorRT-LLM's shape, a priority out of 1-100 is a
400 (INVALID_ARGUMENT) naming the field, and the server keeps serving."""

from __future__ import annotations

import grpc
import httpx
import pytest

from batchserve.entrypoints.grpc.pb import generation_pb2 as pb
from tests.server.fakes import fake_engine
from tests.server.grpc_live import LiveGrpc
from tests.server.live import start_server


@pytest.fixture(scope="module")
def servers():
    http = start_server(fake_engine(delay_s=0.002), served_model_name=["fake"])
    live = LiveGrpc(http.async_engine, ["fake"], max_request_bytes=64 * 1024)
    yield http, live
    live.stop()
    http.stop()


def test_http_accepts_a_retention_and_refuses_a_priority_out_of_range(servers):
    http, _ = servers
    good = {"token_range_retention_configs": [{"token_start": 0, "token_end": 4, "priority": 90, "duration_ms": 5e3}]}
    reply = httpx.post(http.url + "/v1/completions", json={"prompt": "a b", "max_tokens": 2, "kv_retention": good})
    assert reply.status_code == 200, reply.text
    for bad, param in [
        ({"token_ranges": [{"token_start": 0, "priority": 101}]}, "kv_retention.token_ranges[0].priority"),
        ({"token_ranges": [{"token_start": 0, "priority": 0}]}, "kv_retention.token_ranges[0].priority"),
        ({"decode_priority": -3}, "kv_retention.decode_priority"),
        (
            {"token_ranges": [{"token_start": 5, "token_end": 2, "priority": 50}]},
            "kv_retention.token_ranges[0].token_end",
        ),
    ]:
        reply = httpx.post(http.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2, "kv_retention": bad})
        assert reply.status_code == 400, reply.text
        assert reply.json()["error"]["param"] == param
    reply = httpx.post(http.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert reply.status_code == 200


def test_grpc_accepts_a_retention_and_refuses_a_priority_out_of_range(servers):
    _, live = servers
    good = pb.KVRetention(token_ranges=[pb.TokenRangeRetention(token_start=0, token_end=8, priority=90, duration_s=60)])
    request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2, kv_retention=good))
    (ok,) = live.generation.Generate(request, timeout=30)
    assert len(ok.token_ids) == 2
    bad = pb.KVRetention(token_ranges=[pb.TokenRangeRetention(token_start=0, priority=200)])
    request = pb.GenerateRequest(text="hi", sampling=pb.SamplingParams(max_tokens=2, kv_retention=bad))
    with pytest.raises(grpc.RpcError) as info:
        list(live.generation.Generate(request, timeout=30))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "kv_retention.token_ranges[0].priority" in info.value.details()
