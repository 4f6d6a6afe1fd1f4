"""`batchserve serve --grpc-port` on SmolLM2 (the default model), in a process of its own: greedy text is the same
through the OpenAI endpoint, batchserve.v1.Generate (unary and streamed) and tritonclient.grpc's infer and
stream_infer on the TensorRT-LLM ensemble's tensors; SIGTERM drains and exits 0."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys

import grpc
import httpx
import numpy as np
import pytest
import tritonclient.grpc as triton

from batchserve.entrypoints.grpc.pb import generation_pb2 as pb
from batchserve.entrypoints.grpc.pb import generation_pb2_grpc as pb_grpc
from batchserve.entrypoints.openai.launch import free_port
from tests.server.live import wait_for_health

PROMPT = "The capital of France is"
MAX_TOKENS = 12
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def served():
    port, grpc_port = free_port(), free_port()
    command = [sys.executable, "-m", "batchserve.cli", "serve", "--port", str(port), "--grpc-port", str(grpc_port),
               "--num-kv-blocks", "128", "--max-batch-size", "8", "--max-model-len", "512", "--dtype", "float32",
               "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(command, cwd=ROOT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_health(proc, url, timeout_s=600, interval_s=0.5)  # the model loads (and the kernels may build) first
        yield proc, url, f"127.0.0.1:{grpc_port}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def triton_inputs(stream: bool) -> list[triton.InferInput]:
    arrays = [("text_input", np.array([[PROMPT]], dtype=object), "BYTES"),
              ("max_tokens", np.array([[MAX_TOKENS]], dtype=np.int32), "INT32"),
              ("stream", np.array([[stream]]), "BOOL")]  # fmt: skip
    inputs = []
    for name, array, datatype in arrays:
        inputs.append(triton.InferInput(name, list(array.shape), datatype))
        inputs[-1].set_data_from_numpy(array)
    return inputs


@pytest.mark.slow
def test_every_front_end_gives_the_same_greedy_text_and_sigterm_drains(served):
    proc, url, target = served
    body = {"prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0}
    expected = httpx.post(url + "/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    assert expected.strip()

    with grpc.insecure_channel(target) as channel:
        stub = pb_grpc.GenerationStub(channel)
        request = pb.GenerateRequest(text=PROMPT, return_text=True,
                                     sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0))  # fmt: skip
        (whole,) = stub.Generate(request, timeout=120)
        assert whole.text == expected and whole.usage.completion_tokens == len(whole.token_ids)
        request.stream = True
        assert "".join(m.text for m in stub.Generate(request, timeout=120)) == expected

    client = triton.InferenceServerClient(target)
    result = client.infer("ensemble", triton_inputs(stream=False))
    assert result.as_numpy("text_output")[0][0].decode() == expected  # no top_k/top_p: greedy, as TensorRT-LLM
    results: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: results.put(error or result))
    client.async_stream_infer("ensemble", triton_inputs(stream=True), request_id="e2e")
    parts = []
    while True:
        item = results.get(timeout=120)
        assert not isinstance(item, Exception), item
        parts.append(item.as_numpy("text_output")[0][0].decode())
        if item.get_response().parameters["triton_final_response"].bool_param:
            break
    client.stop_stream()
    client.close()
    assert "".join(parts) == expected

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0  # nothing was in flight: nothing lost
