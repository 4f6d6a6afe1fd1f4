"""KServe v2 inference over HTTP (POST /v2/models/{name}[/versions/{version}]/infer) as `tritonclient.http` speaks it,
with the TensorRT-LLM ensemble's tensors that gRPC ModelInfer takes, answered once.

Inputs come as JSON `data` or in Triton's binary extension: the JSON header is the body's first
`Inference-Header-Content-Length` bytes, and each input whose `parameters.binary_data_size` is set has that many bytes
after it, in input order (BYTES elements as 4-byte little-endian lengths and the bytes, as over gRPC). Outputs are JSON
`data`, or binary where the caller asks (an output's `parameters.binary_data`, or the request's `binary_data_output`,
which tritonclient sets when it names no outputs); then the response is the JSON header followed by those bytes.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from batchserve.entrypoints.grpc.status import invalid
from batchserve.entrypoints.kserve.model import VERSION, KServeModel
from batchserve.entrypoints.kserve.tensors import Output, Tensor, _element_count, _raw_values
from batchserve.entrypoints.kserve.trtllm import TrtllmRequest, outputs_of, parse_request, submit
from batchserve.entrypoints.openai.errors import APIError, as_api_error
from batchserve.entrypoints.openai.front import OpenAIFrontEnd
from batchserve.entrypoints.openai.streaming import wait_for_disconnect

HEADER_LENGTH = "Inference-Header-Content-Length"


def add_infer_routes(app: FastAPI, front: OpenAIFrontEnd, model: KServeModel) -> None:
    service = front.service

    @app.post("/v2/models/{name}/infer")
    @app.post("/v2/models/{name}/versions/{version}/infer")
    async def infer(name: str, request: Request, version: str = "") -> Response:
        streams: list[Any] = []
        try:
            model.check(name, version)
            header, blobs = split_body(
                await read_body(request, front.max_body_bytes), request.headers.get(HEADER_LENGTH)
            )
            tensors = decode_inputs(header, blobs)
            requested, binary = requested_outputs(header)
            values = {n: t.values for n, t in tensors.items()}
            trt = parse_request(values, {n: len(t.shape) for n, t in tensors.items()}, requested)
            trt.answer_once("generate_stream or gRPC ModelStreamInfer; infer answers once")
            streams = await submit(service, trt, _priority(header))
            (result,) = await service.final_results(streams, wait_for_disconnect(request))
        except Exception as exc:  # noqa: BLE001 - answered in Triton's shape
            service.abort_unfinished(streams)
            error = as_api_error(exc)
            return JSONResponse({"error": error.message}, status_code=error.status, headers=error.headers)
        outputs = outputs_of(trt, result, delta=False, prefix=_prefix(trt))
        return infer_response(name, header.get("id"), outputs, binary)


async def read_body(request: Request, limit: int) -> bytes:
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise APIError(413, f"request body is over {limit} bytes", code="body_too_large")
    return bytes(body)


def split_body(body: bytes, header_length: str | None) -> tuple[dict[str, Any], bytes]:
    """(the JSON header, the binary data after it)."""
    size = len(body)
    if header_length is not None:
        try:
            size = int(header_length)
        except ValueError:
            raise invalid(f"{HEADER_LENGTH} must be an integer, got {header_length!r}", HEADER_LENGTH) from None
        if not 0 <= size <= len(body):
            raise invalid(f"{HEADER_LENGTH} {size} does not fit a body of {len(body)} bytes", HEADER_LENGTH)
    try:
        header = json.loads(body[:size])
    except RecursionError:
        raise invalid("the request's JSON is nested too deeply", "body") from None
    except ValueError as exc:
        raise invalid(f"the request's JSON is malformed: {exc}", "body") from None
    if not isinstance(header, dict) or not isinstance(header.get("inputs"), list):
        raise invalid("the request must be a JSON object with a list of 'inputs'", "inputs")
    return header, body[size:]


def decode_inputs(header: dict[str, Any], blobs: bytes) -> dict[str, Tensor]:
    """Every input by name, from its JSON data or its share of the binary data."""
    tensors: dict[str, Tensor] = {}
    offset = 0
    for item in header["inputs"]:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            raise invalid("each input must be an object with a 'name'", "inputs")
        name, datatype, shape = item["name"], item.get("datatype"), item.get("shape")
        if name in tensors:
            raise invalid(f"input '{name}' is given twice", name)
        if not isinstance(shape, list) or not all(isinstance(d, int) for d in shape) or not isinstance(datatype, str):
            raise invalid(f"input '{name}' needs a 'shape' (list of integers) and a 'datatype'", name)
        count = _element_count(name, shape)
        size = (item.get("parameters") or {}).get("binary_data_size")
        if size is not None:
            if not isinstance(size, int) or size < 0 or offset + size > len(blobs):
                raise invalid(f"input '{name}': binary_data_size {size!r} runs past the body's binary data", name)
            values = _raw_values(_Described(name, datatype, shape), blobs[offset : offset + size], count)
            offset += size
        else:
            values = _json_values(name, datatype, item.get("data"), count)
        tensors[name] = Tensor(name, datatype, tuple(shape), values)
    if offset != len(blobs):
        raise invalid(f"the body holds {len(blobs) - offset} bytes of binary data no input claims", "inputs")
    return tensors


class _Described:
    """What _raw_values reads of a tensor (the gRPC message's fields)."""

    def __init__(self, name: str, datatype: str, shape: list[int]) -> None:
        self.name, self.datatype, self.shape = name, datatype, shape


def _json_values(name: str, datatype: str, data: Any, count: int) -> list[Any]:
    values = _flat(data) if data is not None else []
    if datatype == "BYTES" and not all(isinstance(v, str) for v in values):
        raise invalid(f"input '{name}': BYTES data must be strings in JSON", name)
    if len(values) != count:
        raise invalid(f"input '{name}' holds {len(values)} elements, its shape says {count}", name)
    return values


def _flat(value: Any) -> list[Any]:
    if not isinstance(value, list):
        return [value]
    return [item for element in value for item in _flat(element)]


def requested_outputs(header: dict[str, Any]) -> tuple[list[str], set[str] | bool]:
    """(output names asked for, which of them go as binary: a set, or True for all)."""
    parameters = header.get("parameters") or {}
    outputs = header.get("outputs") or []
    if not isinstance(outputs, list) or not all(
        isinstance(o, dict) and isinstance(o.get("name"), str) for o in outputs
    ):
        raise invalid("'outputs' must be a list of objects with a 'name'", "outputs")
    binary = {o["name"] for o in outputs if (o.get("parameters") or {}).get("binary_data")}
    return [o["name"] for o in outputs], True if parameters.get("binary_data_output") else binary


def infer_response(name: str, request_id: Any, outputs: Sequence[Output], binary: set[str] | bool) -> Response:
    reply: dict[str, Any] = {"model_name": name, "model_version": VERSION, "outputs": []}
    if isinstance(request_id, str) and request_id:
        reply["id"] = request_id
    blobs = []
    for output in outputs:
        tensor = {"name": output.name, "datatype": output.datatype, "shape": list(output.shape)}
        if binary is True or output.name in binary:
            blobs.append(output.raw())
            tensor["parameters"] = {"binary_data_size": len(blobs[-1])}
        else:
            tensor["data"] = list(output.values)
        reply["outputs"].append(tensor)
    header = json.dumps(reply, ensure_ascii=False).encode()
    if not blobs:
        return Response(header, media_type="application/json")
    headers = {HEADER_LENGTH: str(len(header))}
    return Response(header + b"".join(blobs), media_type="application/octet-stream", headers=headers)


def _priority(header: dict[str, Any]) -> int:
    priority = (header.get("parameters") or {}).get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise invalid("parameters.priority must be an integer", "priority")
    return priority


def _prefix(trt: TrtllmRequest) -> str:
    return "" if trt.exclude_input else trt.text
