"""The FastAPI app: OpenAI routes over the serving layer, plus /tokenize, /detokenize, /health and /metrics.

Routes: POST /v1/completions, POST /v1/chat/completions (SSE streaming or not), POST /v1/responses (and GET|DELETE
/v1/responses/{id}), POST /v1/messages and /v1/messages/count_tokens, POST /v1/embeddings, /v1/score and
/v1/rerank (a pooling runner's), GET /v1/models, GET /health, GET|POST
/ping (as /health: vLLM's name), GET /version,
POST /tokenize, POST /detokenize, GET /metrics (Prometheus).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from batchserve import __version__
from batchserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from batchserve.engine.llm_engine import LLMEngine, QueueFullError
from batchserve.entrypoints.kserve.http import add_kserve_routes
from batchserve.entrypoints.openai.access_log import AccessLog
from batchserve.entrypoints.openai.chat import chat_prompt, create_chat_completion
from batchserve.entrypoints.openai.completions import create_completion
from batchserve.entrypoints.openai.embeddings import BODIES as POOLING_BODIES
from batchserve.entrypoints.openai.embeddings import add_pooling_routes, served_task
from batchserve.entrypoints.openai.error_delay import ErrorDelayCollector, ErrorDelayMiddleware, OffenderTable
from batchserve.entrypoints.openai.errors import APIError, APIKeyMiddleware, as_api_error
from batchserve.entrypoints.openai.front import DEFAULT_MAX_BODY_BYTES, OpenAIFrontEnd
from batchserve.entrypoints.openai.lora_routes import adapter_cards, add_lora_routes
from batchserve.entrypoints.openai.messages import CountTokensRequest, MessagesRequest, add_messages_routes
from batchserve.entrypoints.openai.observability import add_observability
from batchserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from batchserve.entrypoints.openai.responses import ResponsesRequest, add_responses_routes
from batchserve.entrypoints.openai.unsupported import answer_unsupported_endpoints
from batchserve.sampling_params import InvalidRequestError
from batchserve.serving.client import EngineClient
from batchserve.serving.errors import ServingError
from batchserve.serving.generation import GenerationService
from batchserve.serving.metrics import CONTENT_TYPE, EngineMetrics

if TYPE_CHECKING:  # OpenTelemetry is an extra (batchserve[tracing]): imported only when traces are asked for
    from batchserve.serving.tracing import RequestTracer

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_STALL_TIMEOUT_S = 120.0  # far above the longest step (a 2,048-token prefill takes ~2 s on 2 CPU cores)


def build_app(
    engine: LLMEngine | AsyncLLMEngine,
    *,
    served_model_name: str | Sequence[str] | None = None,
    api_key: str | None = None,
    api_key_protects_metrics: bool = False,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics: EngineMetrics | None = None,
    stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    lenient: bool = False,
    tracer: RequestTracer | None = None,
    access_log: AccessLog | None = None,
    offenders: OffenderTable | None = None,
) -> FastAPI:
    """The app over an LLMEngine (wrapped and owned: its loop stops with the app) or an AsyncLLMEngine (shared: the
    caller starts and stops it; the app starts it if needed). /health answers 503 once the engine loop has made no
    progress for `stall_timeout_s` with requests pending. `lenient`: request fields the server does not act on are
    dropped with a logged warning instead of answered 400. `tracer`, `access_log`: request spans and JSON access
    lines (--otlp-traces-endpoint, --log-format json). `api_key_protects_metrics`: /metrics needs the key too.
    `offenders`: repeat offenders' 4xx answers are delayed (--error-delay-max; error_delay.py)."""
    owned = isinstance(engine, LLMEngine)
    async_engine = AsyncLLMEngine(engine) if isinstance(engine, LLMEngine) else engine
    names = model_names(served_model_name, async_engine.config.model)
    metrics = (metrics or EngineMetrics(model_name=names[0])).attach(async_engine)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        app.state.front.service.constraints.close()  # a grammar compile in progress is killed, not waited for
        app.state.front.body_parser.close()
        if owned:  # uvicorn has already waited for the in-flight requests (graceful shutdown)
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    async def health_problem() -> str | None:
        return engine_problem(async_engine, stall_timeout_s)

    app = build_front_app(
        async_engine, names, api_key=api_key, max_body_bytes=max_body_bytes, lenient=lenient,
        render_metrics=metrics.render, health_problem=health_problem, lifespan=lifespan,
        api_key_protects_metrics=api_key_protects_metrics, offenders=offenders,
    )  # fmt: skip
    if offenders is not None:
        metrics.registry.register(ErrorDelayCollector(offenders, names[0]))
    app.state.async_engine = async_engine
    app.state.metrics = metrics
    add_observability(app, async_engine, tracer, access_log)  # /dashboard, X-Request-Id, traces, access log
    return app


def build_front_app(
    client: EngineClient,
    served_model_names: Sequence[str],
    *,
    api_key: str | None,
    max_body_bytes: int,
    lenient: bool,
    render_metrics: Callable[[], Awaitable[bytes] | bytes],
    health_problem: Callable[[], Awaitable[str | None]],
    lifespan: Callable[[FastAPI], contextlib.AbstractAsyncContextManager[None]] | None = None,
    api_key_protects_metrics: bool = False,
    offenders: OffenderTable | None = None,
) -> FastAPI:
    """The OpenAI (and KServe) routes over any EngineClient: one engine in this process, or a Ray Serve deployment
    of them (batchserve.distributed). `render_metrics` answers /metrics; `health_problem` is None when healthy,
    else why /health answers 503."""
    front = OpenAIFrontEnd(GenerationService(client), served_model_names, max_body_bytes, lenient)
    app = FastAPI(title="batchserve", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.front = front
    _add_error_handlers(app)
    _add_routes(app, front, client, render_metrics)
    add_lora_routes(app, front, client)  # adapters by `model`; load/unload behind --allow-runtime-lora-updating
    add_responses_routes(app, front)  # /v1/responses: OpenAI's Responses API over the same service
    add_messages_routes(app, front)  # /v1/messages: Anthropic's Messages API over the same service
    add_pooling_routes(app, front)  # /v1/embeddings, /v1/score, /v1/rerank: a pooling runner's
    add_kserve_routes(app, front)  # /v2/...: Triton's generate extension for TensorRT-LLM callers
    _add_health(app, health_problem)
    _document_request_bodies(app)
    answer_unsupported_endpoints(app)  # other APIs' endpoints: what to use instead, behind every real route
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key, protect_metrics=api_key_protects_metrics)
    app.state.offenders = offenders
    if offenders is not None and offenders.config.enabled:  # outside the key check: a key guesser waits too
        app.add_middleware(ErrorDelayMiddleware, offenders=offenders)
    return app


def engine_problem(engine: AsyncLLMEngine, stall_timeout_s: float) -> str | None:
    """Why a local engine cannot serve (dead loop, or no progress for `stall_timeout_s` with requests pending)."""
    if not engine.is_running and engine.error is not None:
        return f"engine loop died: {engine.error!r}"
    stalled = engine.stalled_for()
    if stalled > stall_timeout_s:
        return f"the engine loop has made no progress for {stalled:.0f} s with requests pending"
    return None


def model_names(served_model_name: str | Sequence[str] | None, model: str | None) -> list[str]:
    if isinstance(served_model_name, str):
        return [served_model_name]
    if served_model_name:
        return list(served_model_name)
    return [model or DEFAULT_MODEL_NAME]


def _add_error_handlers(app: FastAPI) -> None:
    async def api_error(_: Request, exc: Exception) -> Response:
        return as_api_error(exc).response()

    async def http_error(_: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type_=kind).response()

    # engine errors get their own handlers: the catch-all one for Exception answers but re-raises (a logged 500)
    for exc_type in (APIError, RequestValidationError, InvalidRequestError, QueueFullError, EngineDeadError,
                     ServingError, Exception):  # fmt: skip
        app.add_exception_handler(exc_type, api_error)
    app.add_exception_handler(StarletteHTTPException, http_error)


def _add_routes(
    app: FastAPI, front: OpenAIFrontEnd, client: EngineClient, render_metrics: Callable[[], Awaitable[bytes] | bytes]
) -> None:
    service = front.service

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await create_completion(front, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await create_chat_completion(front, request)

    @app.get("/v1/models")
    async def models() -> Response:
        card = {
            "root": client.config.model,
            "max_model_len": service.limits.max_model_len,
            "dtype": client.config.dtype,
            **served_task(client.config),
        }
        cards = [ModelCard(id=name, **card) for name in front.served_model_names]
        cards += adapter_cards(client, front.model_name, card)
        return JSONResponse(ModelList(data=cards).model_dump())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        req = await front.parse(request, TokenizeRequest)
        if req.messages is not None:
            ids = await chat_prompt(service, req.messages, req.add_generation_prompt)
        elif req.prompt is not None:
            ids = await service.tokenize(req.prompt, req.add_special_tokens)
        else:
            raise APIError(400, "give 'prompt' or 'messages'", param="prompt")
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": service.limits.max_model_len})

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        req = await front.parse(request, DetokenizeRequest)
        # off the event loop: hundreds of thousands of ids take long enough to stall every stream
        return JSONResponse({"prompt": await front.off_loop(service.detokenize, req.tokens)})

    @app.get("/metrics")
    async def prometheus() -> Response:
        body = render_metrics()
        return Response(await body if inspect.isawaitable(body) else body, media_type=CONTENT_TYPE)


def _add_health(app: FastAPI, health_problem: Callable[[], Awaitable[str | None]]) -> None:
    @app.get("/health")
    async def health() -> Response:
        problem = await health_problem()
        if problem is not None:
            return as_api_error(EngineDeadError(problem)).response()
        return JSONResponse({"status": "ok"})

    async def ping() -> Response:  # vLLM's (and SageMaker's) liveness probe: /health's answer
        return await health()

    for method in ("GET", "POST"):  # one route per method, so the OpenAPI schema's operation ids stay unique
        app.add_api_route("/ping", ping, methods=[method], operation_id=f"ping_{method.lower()}")

    @app.get("/version")
    async def version() -> Response:
        return JSONResponse({"version": __version__})


# The routes read their bodies themselves (size limit first, then strict validation): their schemas go into the
# OpenAPI document by hand, so that clients and schema fuzzers see what each route takes.
_BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/responses": ResponsesRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    **POOLING_BODIES,
}


def _document_request_bodies(app: FastAPI) -> None:
    plain_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            document = plain_openapi()
            components = document.setdefault("components", {}).setdefault("schemas", {})
            for path, model in _BODIES.items():
                schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(schema.pop("$defs", {}))
                components[model.__name__] = schema
                body = {"$ref": f"#/components/schemas/{model.__name__}"}
                document["paths"][path]["post"]["requestBody"] = {
                    "required": True,
                    "content": {"application/json": {"schema": body}},
                }
            app.openapi_schema = document
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
