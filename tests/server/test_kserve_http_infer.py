"""KServe v2 inference over HTTP with `tritonclient.http`: POST /v2/models/<model>/infer with binary and
JSON tensors, model ready and metadata, results equal to the OpenAI endpoint's, on the model-free engine's server."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

tritonhttp = pytest.importorskip("tritonclient.http")  # needs tritonclient[http] (gevent)
from tritonclient.utils import InferenceServerException  # noqa: E402

from tests.server.fakes import fake_engine  # noqa: E402
from tests.server.live import start_server  # noqa: E402

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def served():
    http = start_server(fake_engine(delay_s=0.002), served_model_name=["fake"])
    client = tritonhttp.InferenceServerClient(http.url.removeprefix("http://"))
    yield http, client
    client.close()
    http.stop()


def tensor(name: str, value, datatype: str, binary: bool = True):
    array = np.array([[value]], dtype=object if datatype == "BYTES" else {"INT32": np.int32, "BOOL": bool}[datatype])
    t = tritonhttp.InferInput(name, list(array.shape), datatype)
    t.set_data_from_numpy(array, binary_data=binary)
    return t


def openai_text(http, max_tokens: int) -> str:
    body = {"model": "fake", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0}
    return httpx.post(http.url + "/v1/completions", json=body, timeout=30).json()["choices"][0]["text"]


@pytest.mark.parametrize("binary", [True, False])
def test_infer_equals_the_openai_endpoint(served, binary):
    http, client = served
    inputs = [tensor("text_input", PROMPT, "BYTES", binary), tensor("max_tokens", 9, "INT32", binary)]
    result = client.infer("ensemble", inputs, request_id="7")
    assert result.get_response()["id"] == "7"
    assert result.as_numpy("text_output").shape == (1, 1)
    assert result.as_numpy("text_output")[0][0].decode() == openai_text(http, 9)


def test_outputs_asked_for_as_json_or_binary(served):
    http, client = served
    outputs = [tritonhttp.InferRequestedOutput("text_output", binary_data=False),
               tritonhttp.InferRequestedOutput("output_ids", binary_data=True),
               tritonhttp.InferRequestedOutput("sequence_length", binary_data=False)]  # fmt: skip
    inputs = [tensor("text_input", PROMPT, "BYTES"), tensor("max_tokens", 5, "INT32")]
    result = client.infer("fake", inputs, outputs=outputs)
    ids = result.as_numpy("output_ids")
    assert ids.shape == (1, 1, 5) and ids.dtype == np.int32 and result.as_numpy("sequence_length")[0][0] == 5
    assert result.as_numpy("text_output")[0][0] == openai_text(http, 5)  # JSON data: a str
    assert result.as_numpy("cum_log_probs") is None


def test_ready_metadata_and_errors(served):
    _, client = served
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("ensemble") and client.is_model_ready("fake") and not client.is_model_ready("nope")
    metadata = client.get_model_metadata("ensemble")
    assert {"text_input", "max_tokens"} <= {i["name"] for i in metadata["inputs"]}
    with pytest.raises(InferenceServerException, match="beam_width"):
        client.infer("ensemble", [tensor("text_input", PROMPT, "BYTES"), tensor("max_tokens", 4, "INT32"),
                                  tensor("beam_width", 2, "INT32")])  # fmt: skip
    with pytest.raises(InferenceServerException, match="unknown model"):
        client.infer("nope", [tensor("text_input", PROMPT, "BYTES"), tensor("max_tokens", 4, "INT32")])
    with pytest.raises(InferenceServerException, match="infer answers once"):
        client.infer("ensemble", [tensor("text_input", PROMPT, "BYTES"), tensor("max_tokens", 4, "INT32"),
                                  tensor("stream", True, "BOOL")])  # fmt: skip
    with pytest.raises(InferenceServerException, match="num_return_sequences > 1 .* infer answers once"):
        client.infer("ensemble", [tensor("text_input", PROMPT, "BYTES"), tensor("max_tokens", 4, "INT32"),
                                  tensor("num_return_sequences", 2, "INT32")])  # fmt: skip


def test_malformed_bodies_are_400(served):
    http, _ = served
    url = http.url + "/v2/models/ensemble/infer"
    text = {"name": "text_input", "shape": [1, 1], "datatype": "BYTES", "data": [PROMPT]}
    too_long = {"name": "max_tokens", "shape": [1, 1], "datatype": "INT32", "parameters": {"binary_data_size": 40}}
    cases = [
        (b"{not json", {}),
        (b'{"inputs": {}}', {}),
        (httpx.Request("POST", url, json={"inputs": [text, too_long]}).content + b"\x01\x00\x00\x00", {}),
        (b'{"inputs": []}xx', {"Inference-Header-Content-Length": "99"}),
    ]
    for body, headers in cases:
        reply = httpx.post(url, content=body, headers=headers, timeout=10)
        assert reply.status_code == 400 and reply.json()["error"], (body, reply.text)
