"""KServe v2 / Triton with the TensorRT-LLM ensemble's tensors, on the model-free engine shared with the HTTP
server: tritonclient.grpc infer and stream_infer, Triton's HTTP generate extension, results equal to the OpenAI
endpoint's, streams that concatenate to the unary result and end with triton_final_response, cancelled streams that
free every block, and the refused-input catalogue."""

from __future__ import annotations

import json
import queue

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton
from tritonclient.utils import InferenceServerException

from batchserve.entrypoints.kserve.pb import kserve_pb2 as kpb
from tests.server.fakes import fake_engine
from tests.server.grpc_live import LiveGrpc
from tests.server.live import start_server

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def servers():
    http = start_server(fake_engine(delay_s=0.002), served_model_name=["fake"])
    live = LiveGrpc(http.async_engine, ["fake"])
    client = triton.InferenceServerClient(live.target)
    yield http, live, client
    client.close()
    live.stop()
    http.stop()


def tensor(name: str, value, datatype: str, batched: bool = True) -> triton.InferInput:
    array = np.array([[value]] if batched else [value], dtype=object if datatype == "BYTES" else None)
    if datatype == "INT32":
        array = array.astype(np.int32)
    if datatype == "FP32":
        array = array.astype(np.float32)
    t = triton.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array)
    return t


def ensemble_inputs(text: str = PROMPT, max_tokens: int = 12, **extra) -> list[triton.InferInput]:
    types = {"stream": "BOOL", "temperature": "FP32", "top_k": "INT32", "top_p": "FP32", "end_id": "INT32",
             "return_log_probs": "BOOL", "exclude_input_in_output": "BOOL", "beam_width": "INT32",
             "bad_words": "BYTES", "stop_words": "BYTES", "lora_weights": "FP32", "foo": "INT32",
             "return_num_output_tokens": "BOOL", "min_length": "INT32", "num_return_sequences": "INT32"}  # fmt: skip
    inputs = [tensor("text_input", text, "BYTES"), tensor("max_tokens", max_tokens, "INT32")]
    return inputs + [tensor(name, value, types[name]) for name, value in extra.items()]


def openai_text(http, max_tokens: int = 12) -> str:
    body = {"model": "fake", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(http.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]


def stream(client, inputs, request_id: str = "s", **options) -> list:
    """Every result of one streamed request, up to its triton_final_response."""
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put(error or result))
    try:
        client.async_stream_infer("ensemble", inputs, request_id=request_id, **options)
        got = []
        while True:
            item = results.get(timeout=30)
            if isinstance(item, InferenceServerException):
                raise item
            got.append(item)
            if item.get_response().parameters["triton_final_response"].bool_param:
                return got
    finally:
        client.stop_stream()


def test_infer_equals_the_openai_endpoint(servers):
    http, _, client = servers
    result = client.infer("ensemble", ensemble_inputs(), request_id="42")
    assert result.get_response().id == "42"
    assert result.as_numpy("text_output").shape == (1, 1)
    assert result.as_numpy("text_output")[0][0].decode() == openai_text(http)
    for name in ("fake", "ensemble"):
        assert client.is_model_ready(name)
    flat = client.infer("fake", [tensor("text_input", PROMPT, "BYTES", batched=False),
                                 tensor("max_tokens", 12, "INT32", batched=False)])  # fmt: skip
    assert flat.as_numpy("text_output")[0].decode() == openai_text(http)  # vLLM-backend style: no batch dimension


def test_stream_infer_concatenates_and_flags_the_final_response(servers):
    _, _, client = servers
    whole = client.infer("ensemble", ensemble_inputs(), request_id="w").as_numpy("text_output")[0][0].decode()
    results = stream(client, ensemble_inputs(stream=True), request_id="s1")
    assert len(results) == 12 and all(r.get_response().id == "s1" for r in results)
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
    assert finals == [False] * 11 + [True]
    assert "".join(r.as_numpy("text_output")[0][0].decode() for r in results) == whole
    # asked for: an empty response of its own carries the final flag
    results = stream(client, ensemble_inputs(stream=True), request_id="s2", enable_empty_final_response=True)
    assert len(results) == 13 and results[-1].as_numpy("text_output") is None
    assert "".join(r.as_numpy("text_output")[0][0].decode() for r in results[:-1]) == whole
    (single,) = stream(client, ensemble_inputs(), request_id="s3")  # stream=false on the stream: one response
    assert single.as_numpy("text_output")[0][0].decode() == whole


def test_token_ids_and_counts_where_asked(servers):
    _, _, client = servers
    outputs = [triton.InferRequestedOutput(n) for n in ("text_output", "output_ids", "sequence_length",
                                                         "num_input_tokens")]  # fmt: skip
    result = client.infer("ensemble", ensemble_inputs(max_tokens=5), outputs=outputs)
    ids = result.as_numpy("output_ids")
    assert ids.shape == (1, 1, 5) and ids.dtype == np.int32 and result.as_numpy("sequence_length")[0][0] == 5
    assert result.as_numpy("num_input_tokens")[0][0] == len(PROMPT)  # the byte tokenizer: one token per byte
    assert result.as_numpy("cum_log_probs") is None
    prefixed = client.infer("ensemble", ensemble_inputs(max_tokens=5, exclude_input_in_output=False))
    assert prefixed.as_numpy("text_output")[0][0].decode().startswith(PROMPT)


def test_end_id_stops_like_eos(servers):
    _, _, client = servers
    outputs = [triton.InferRequestedOutput("output_ids")]
    ids = list(client.infer("ensemble", ensemble_inputs(), outputs=outputs).as_numpy("output_ids")[0][0])
    cut = client.infer("ensemble", ensemble_inputs(end_id=int(ids[2])), outputs=outputs).as_numpy("output_ids")
    assert list(cut[0][0]) == ids[: ids.index(ids[2]) + 1]


def test_metadata_and_config(servers):
    _, _, client = servers
    assert client.is_server_live() and client.is_server_ready()
    metadata = client.get_model_metadata("ensemble")
    assert {"text_input", "max_tokens", "stream"} <= {i.name for i in metadata.inputs}
    assert metadata.outputs[0].name == "text_output" and metadata.outputs[0].datatype == "BYTES"
    config = client.get_model_config("ensemble").config
    assert config.model_transaction_policy.decoupled and config.max_batch_size == 1
    assert client.get_server_metadata().name == "batchserve"


REFUSED = [
    (dict(foo=1), "unexpected input 'foo'"),
    (dict(beam_width=2), "beam_width"),
    (dict(bad_words="damn"), "bad_words"),
    (dict(lora_weights=3.0), "LoRA weights sent with a request"),
    (dict(temperature=-1.0, top_k=5), "temperature"),
    (dict(stream=True), "ModelStreamInfer"),  # ModelInfer answers once
    (dict(min_length=50), "min_tokens"),
    (dict(num_return_sequences=2), "needs ModelStreamInfer"),  # one response per sequence
    (dict(num_return_sequences=0), "num_return_sequences must be between 1 and 128, got 0"),
    (dict(num_return_sequences=-3), "num_return_sequences must be between 1 and 128, got -3"),
    (dict(num_return_sequences=129), "num_return_sequences must be between 1 and 128, got 129"),
]


@pytest.mark.parametrize("extra,needle", REFUSED)
def test_refused_input_is_invalid_argument(servers, extra, needle):
    _, _, client = servers
    with pytest.raises(InferenceServerException) as info:
        client.infer("ensemble", ensemble_inputs(**extra))
    assert info.value.status() == "StatusCode.INVALID_ARGUMENT" and needle in info.value.message()


def test_malformed_requests(servers):
    _, live, client = servers
    with pytest.raises(InferenceServerException) as info:
        client.infer("ensemble", [tensor("text_input", PROMPT, "BYTES")])
    assert "max_tokens" in info.value.message() and info.value.status() == "StatusCode.INVALID_ARGUMENT"
    with pytest.raises(InferenceServerException) as info:
        client.infer("gpt-4", ensemble_inputs())
    assert info.value.status() == "StatusCode.NOT_FOUND"
    bad = kpb.ModelInferRequest(model_name="ensemble")  # a BYTES length running past its data
    bad.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    bad.raw_input_contents.append(b"\xff\x00\x00\x00abc")
    with pytest.raises(grpc.RpcError) as error:
        live.kserve.ModelInfer(bad, timeout=30)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "past the end" in error.value.details()
    assert client.infer("ensemble", ensemble_inputs(max_tokens=2)).as_numpy("text_output") is not None


def test_an_error_on_the_stream_is_in_band_and_the_stream_goes_on(servers):
    _, _, client = servers
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put(error or result))
    try:
        client.async_stream_infer("ensemble", ensemble_inputs(beam_width=4), request_id="bad")
        error = results.get(timeout=30)
        assert isinstance(error, InferenceServerException) and "beam_width" in error.message()
        client.async_stream_infer("ensemble", ensemble_inputs(max_tokens=3), request_id="good")
        good = results.get(timeout=30)
        assert good.get_response().id == "good" and len(good.as_numpy("text_output")[0][0]) == 3
    finally:
        client.stop_stream()


def test_a_cancelled_stream_frees_every_block(servers):
    http, _, client = servers
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put(error or result))
    client.async_stream_infer("ensemble", ensemble_inputs(max_tokens=200, end_id=-1, stream=True))
    results.get(timeout=30), results.get(timeout=30)
    assert http.async_engine.stats().kv_blocks_used > 0
    client.stop_stream(cancel_requests=True)
    http.wait_idle()
    assert http.async_engine.stats().kv_blocks_used == 0


def test_http_generate_extension(servers):
    http, _, _ = servers
    body = {"text_input": PROMPT, "max_tokens": 12, "bad_words": "", "stop_words": [""], "id": "h1"}
    reply = httpx.post(http.url + "/v2/models/ensemble/generate", json=body, timeout=30).json()
    assert reply["text_output"] == openai_text(http) and reply["id"] == "h1" and reply["model_name"] == "ensemble"
    events = []
    with httpx.stream("POST", http.url + "/v2/models/ensemble/generate_stream", json={**body, "stream": True},
                      timeout=30) as response:  # fmt: skip
        assert response.headers["content-type"].startswith("text/event-stream")
        events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
    assert len(events) == 12 and "".join(e["text_output"] for e in events) == reply["text_output"]
    wrong = httpx.post(http.url + "/v2/models/ensemble/generate", json={**body, "beam_width": 2}, timeout=30)
    assert wrong.status_code == 400 and "beam_width" in wrong.json()["error"]
    unknown = httpx.post(http.url + "/v2/models/nope/generate", json=body, timeout=30)
    assert unknown.status_code == 404 and "unknown model" in unknown.json()["error"]
    assert httpx.get(http.url + "/v2/health/ready").status_code == 200
    assert httpx.get(http.url + "/v2/models/ensemble").json()["inputs"][0]["name"] == "text_input"


def _by_sequence(results) -> dict[int, str]:
    texts: dict[int, str] = {}
    for result in results:
        index = int(result.as_numpy("sequence_index")[0][0])
        texts[index] = texts.get(index, "") + result.as_numpy("text_output")[0][0].decode()
    return texts


@pytest.mark.parametrize("streaming", [True, False])
def test_num_return_sequences_come_as_responses_of_their_own(servers, streaming):
    """As TensorRT-LLM's decoupled model: per sequence, its responses (each step's, or one at its end) with its
    sequence_index; the final flag on the last response of all."""
    http, _, client = servers
    whole = client.infer("ensemble", ensemble_inputs(max_tokens=6)).as_numpy("text_output")[0][0].decode()
    inputs = ensemble_inputs(max_tokens=6, stream=streaming, num_return_sequences=3)
    results = stream(client, inputs, request_id=f"n-{streaming}")
    assert len(results) == (3 * 6 if streaming else 3) and all(r.get_response().id == f"n-{streaming}" for r in results)
    finals = [r.get_response().parameters["triton_final_response"].bool_param for r in results]
    assert finals == [False] * (len(results) - 1) + [True]
    assert _by_sequence(results) == {0: whole, 1: whole, 2: whole}  # the model-free engine ignores temperature
    inputs = ensemble_inputs(max_tokens=4, stream=streaming, num_return_sequences=2, exclude_input_in_output=False)
    prefixed = _by_sequence(stream(client, inputs, request_id="p"))
    assert sorted(prefixed) == [0, 1] and all(text.startswith(PROMPT) and text.count(PROMPT) == 1
                                              for text in prefixed.values())  # fmt: skip
    http.wait_idle()
    assert http.async_engine.stats().kv_blocks_used == 0


def test_num_return_sequences_on_http_generate_stream(servers):
    http, _, _ = servers
    body = {"text_input": PROMPT, "max_tokens": 5, "num_return_sequences": 2}
    whole = httpx.post(http.url + "/v2/models/ensemble/generate", json={**body, "num_return_sequences": 1},
                       timeout=30).json()["text_output"]  # fmt: skip
    for streaming in (True, False):
        with httpx.stream("POST", http.url + "/v2/models/ensemble/generate_stream", json={**body, "stream": streaming},
                          timeout=30) as response:  # fmt: skip
            events = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: ")]
        assert len(events) == (2 * 5 if streaming else 2)
        texts: dict[int, str] = {}
        for event in events:
            texts[event["sequence_index"]] = texts.get(event["sequence_index"], "") + event["text_output"]
        assert texts == {0: whole, 1: whole}
    once = httpx.post(http.url + "/v2/models/ensemble/generate", json=body, timeout=30)
    assert once.status_code == 400 and "num_return_sequences > 1" in once.json()["error"]
    assert "generate_stream" in once.json()["error"]
    bad = httpx.post(http.url + "/v2/models/ensemble/generate_stream", json={**body, "num_return_sequences": 0},
                     timeout=30)  # fmt: skip
    assert bad.status_code == 400 and "num_return_sequences must be between 1 and 128" in bad.json()["error"]
