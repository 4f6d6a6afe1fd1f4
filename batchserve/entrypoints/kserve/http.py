"""KServe v2 over HTTP for Triton/TensorRT-LLM callers, on the OpenAI server's app: Triton's generate extension
(POST /v2/models/{name}/generate, and generate_stream as server-sent events, one per engine step), with the
TensorRT-LLM ensemble's names as top-level JSON keys, v2 inference (POST /v2/models/{name}/infer, http_infer.py),
plus the v2 health and metadata routes. Errors are Triton's
shape, {"error": "<message>"}, with the status the OpenAI routes give the same failure."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import RootModel

from batchserve.entrypoints.grpc.served import ServedModel
from batchserve.entrypoints.grpc.status import invalid
from batchserve.entrypoints.kserve.http_infer import add_infer_routes
from batchserve.entrypoints.kserve.model import VERSION, KServeModel
from batchserve.entrypoints.kserve.tensors import Output
from batchserve.entrypoints.kserve.trtllm import TrtllmRequest, outputs_of, parse_request, responses, submit
from batchserve.entrypoints.openai.errors import as_api_error
from batchserve.entrypoints.openai.front import OpenAIFrontEnd
from batchserve.entrypoints.openai.streaming import AbortOnCloseResponse, wait_for_disconnect

RESERVED_KEYS = ("id", "parameters")  # the generate extension's own keys; every other key is an input


class GenerateBody(RootModel[dict[str, Any]]):
    """A generate request: inputs by name (a scalar or a list each), an optional id and parameters."""


def add_kserve_routes(app: FastAPI, front: OpenAIFrontEnd) -> None:
    model = KServeModel(ServedModel(tuple(front.served_model_names), front.max_body_bytes))
    service = front.service
    add_infer_routes(app, front, model)  # POST .../infer, as tritonclient.http calls it

    @app.get("/v2/health/live")
    async def live() -> Response:
        return Response(status_code=200)

    @app.get("/v2/health/ready")
    async def ready() -> Response:
        return Response(status_code=200 if service.client.is_running else 503)

    @app.get("/v2")
    async def server_metadata() -> Response:
        return JSONResponse({"name": "batchserve", "version": model.served.version, "extensions": ["generate"]})

    @app.get("/v2/models/{name}")
    @app.get("/v2/models/{name}/versions/{version}")
    async def model_metadata(name: str, version: str = "") -> Response:
        try:
            model.check(name, version)
        except Exception as exc:  # noqa: BLE001 - answered in Triton's shape
            return _error(exc)
        return JSONResponse(model.metadata_json(name))

    @app.get("/v2/models/{name}/ready")
    async def model_ready(name: str) -> Response:
        known = name in model.names
        return Response(status_code=200 if known and service.client.is_running else 400 if not known else 503)

    @app.post("/v2/models/{name}/generate")
    @app.post("/v2/models/{name}/versions/{version}/generate")
    async def generate(name: str, request: Request, version: str = "") -> Response:
        streams = []
        try:
            body, trt = await _parse(front, model, name, version, request)
            trt.answer_once("generate_stream (the model is decoupled); generate answers once")
            streams = await submit(service, trt, _priority(body))
            (result,) = await service.final_results(streams, wait_for_disconnect(request))
        except Exception as exc:  # noqa: BLE001 - answered in Triton's shape
            service.abort_unfinished(streams)
            return _error(exc)
        outputs = outputs_of(trt, result, delta=False, prefix="" if trt.exclude_input else trt.text)
        return JSONResponse(_reply(name, body, outputs))

    @app.post("/v2/models/{name}/generate_stream")
    @app.post("/v2/models/{name}/versions/{version}/generate_stream")
    async def generate_stream(name: str, request: Request, version: str = "") -> Response:
        try:
            body, trt = await _parse(front, model, name, version, request)
            streams = await submit(service, trt, _priority(body))
        except Exception as exc:  # noqa: BLE001 - answered in Triton's shape
            return _error(exc)
        events = _events(front, name, body, trt, streams)
        return AbortOnCloseResponse(events, lambda: service.abort_unfinished(streams))


async def _parse(
    front: OpenAIFrontEnd, model: KServeModel, name: str, version: str, request: Request
) -> tuple[dict[str, Any], TrtllmRequest]:
    model.check(name, version)
    body = (await front.parse(request, GenerateBody)).root
    inputs = {k: v for k, v in body.items() if k not in RESERVED_KEYS}
    values = {k: _flat(v, k) for k, v in inputs.items()}
    ranks = {k: _rank(v) for k, v in inputs.items()}
    return body, parse_request(values, ranks, [])


async def _events(
    front: OpenAIFrontEnd, name: str, body: dict[str, Any], trt: TrtllmRequest, streams: list[Any]
) -> AsyncIterator[str]:
    try:
        async for outputs, _ in responses(front.service, trt, streams):
            yield _sse(_reply(name, body, outputs))
    except Exception as exc:  # noqa: BLE001 - the status line is gone: reported in the stream, as Triton does
        yield _sse({"error": as_api_error(exc).message})


def _reply(name: str, body: dict[str, Any], outputs: Sequence[Output]) -> dict[str, Any]:
    reply: dict[str, Any] = {"model_name": name, "model_version": VERSION}
    if isinstance(body.get("id"), str):
        reply["id"] = body["id"]
    for output in outputs:  # a one-element tensor as a scalar, as Triton's generate answers
        reply[output.name] = output.values[0] if len(output.values) == 1 else output.values
    return reply


def _priority(body: dict[str, Any]) -> int:
    parameters = body.get("parameters") or {}
    if not isinstance(parameters, dict):
        raise invalid("'parameters' must be an object", "parameters")
    priority = parameters.get("priority", 0)
    if isinstance(priority, bool) or not isinstance(priority, int):
        raise invalid("parameters.priority must be an integer", "priority")
    return priority


MAX_TENSOR_RANK = 8  # Triton's own bound on dims; deeper nesting is a client's mistake (or an attack on recursion)


def _flat(value: Any, name: str) -> list[Any]:
    """A tensor's elements in order, nested lists read without recursion; deeper than MAX_TENSOR_RANK is a 400."""
    flat: list[Any] = []
    pending: list[tuple[Any, int]] = [(value, 0)]
    while pending:
        item, depth = pending.pop()
        if not isinstance(item, list):
            flat.append(item)
            continue
        if depth >= MAX_TENSOR_RANK:
            raise invalid(f"input '{name}' is nested deeper than {MAX_TENSOR_RANK} dimensions", name)
        pending.extend((element, depth + 1) for element in reversed(item))
    return flat


def _rank(value: Any) -> int:
    rank = 0
    while isinstance(value, list):  # bounded: _flat has refused nesting past MAX_TENSOR_RANK
        rank += 1
        value = value[0] if value else None
    return rank


def _sse(payload: dict[str, Any]) -> str:
    return "data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"


def _error(exc: BaseException) -> JSONResponse:
    error = as_api_error(exc)
    return JSONResponse({"error": error.message}, status_code=error.status, headers=error.headers)
