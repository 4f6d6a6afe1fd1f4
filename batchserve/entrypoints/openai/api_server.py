"""OpenAI-compatible HTTP server: FastAPI app over an AsyncLLMEngine, plus ``main(argv)`` for ``batchserve serve``.

Routes: POST /v1/completions, POST /v1/chat/completions (SSE streaming or not), GET /v1/models, GET /health,
POST /tokenize, POST /detokenize, GET /metrics (Prometheus). Errors are OpenAI-shaped:
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import hmac
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from batchserve.engine.async_engine import AsyncLLMEngine, EngineDeadError, RequestStream
from batchserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    UsageInfo,
    random_id,
)
from batchserve.metrics import CONTENT_TYPE, EngineMetrics
from batchserve.sampling_params import InvalidRequestError, SamplingParams

try:
    from batchserve.engine.llm_engine import QueueFullError
except ImportError:  # pragma: no cover - only while the engine module is being written

    class QueueFullError(RuntimeError):  # type: ignore[no-redef]
        pass


logger = logging.getLogger("batchserve.server")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
OPEN_PATHS = ("/health", "/metrics")
RETRY_AFTER_S = 1
_SAMPLING_FIELDS = {f.name for f in dataclasses.fields(SamplingParams)}  # error messages start with the field


# ---------------------------------------------------------------------------------------------------- errors
class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        type_: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def _as_api_error(exc: BaseException) -> APIError:
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return APIError(400, str(exc), param=_param_of(str(exc)))
    if isinstance(exc, QueueFullError):
        return APIError(
            503,
            f"server overloaded, retry later: {exc}",
            type_="service_unavailable",
            code="queue_full",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), type_="service_unavailable", code="engine_dead")
    logger.exception("internal error", exc_info=exc)
    return APIError(500, f"internal error: {type(exc).__name__}", type_="internal_error")


def _param_of(message: str) -> str | None:
    """The request field an engine error message is about (they start with it, or talk about the prompt)."""
    first = message.split(" ", 1)[0]
    if first in _SAMPLING_FIELDS:
        return first
    return "prompt" if "prompt" in message else None


def _validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = first.get("msg", "invalid request")
    return APIError(400, f"{param}: {message}" if param else message, param=param, code="invalid_value")


class APIKeyMiddleware:
    """``Authorization: Bearer <key>`` on every path but /health and /metrics; compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = ("Bearer " + api_key).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                given = value
                break
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        error = APIError(
            401, "invalid or missing API key", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"}
        )
        await error.response()(scope, receive, send)


class _AbortOnCloseResponse(StreamingResponse):
    """A streaming response that aborts its requests however it ends (done, client gone, or never started)."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


def _sse(payload: dict[str, Any]) -> str:
    return "data: " + json.dumps(payload, ensure_ascii=False, separators=(",", ":")) + "\n\n"


_SSE_DONE = "data: [DONE]\n\n"


# ---------------------------------------------------------------------------------------------------- serving
class OpenAIServing:
    """Turns validated API requests into engine requests, and engine outputs into OpenAI responses."""

    def __init__(
        self,
        engine: AsyncLLMEngine,
        served_model_names: Sequence[str],
        metrics: EngineMetrics,
        max_body_bytes: int,
    ) -> None:
        self.engine = engine
        self.served_model_names = list(served_model_names)
        self.model_name = self.served_model_names[0]
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        scheduler = engine.config.scheduler
        model_config = engine.model_config
        self.max_model_len = scheduler.max_model_len or getattr(model_config, "max_position_embeddings", None) or 2048
        self.max_input_len = scheduler.max_input_len or self.max_model_len - 1
        self.vocab_size = getattr(model_config, "vocab_size", None)

    # ------------------------------------------------------------------ request parsing
    async def parse(self, request: Request, model: type[BaseModel]) -> Any:
        length = request.headers.get("content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_body_bytes
            except ValueError:
                raise APIError(400, "invalid Content-Length header", code="invalid_header") from None
            if too_big:
                raise self._too_big()
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise self._too_big()
        try:
            data = json.loads(body)
        except (ValueError, UnicodeDecodeError) as exc:
            raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
        try:
            parsed = model.model_validate(data)
        except ValidationError as exc:
            raise _validation_error(exc) from None
        self.check_model(getattr(parsed, "model", None))
        return parsed

    def _too_big(self) -> APIError:
        return APIError(413, f"request body is over {self.max_body_bytes} bytes", code="body_too_large")

    def check_model(self, name: str | None) -> None:
        if name is not None and name not in self.served_model_names:
            raise APIError(
                400,
                f"the model '{name}' does not exist; this server serves {self.model_name!r}",
                param="model",
                code="model_not_found",
            )

    def check_token_ids(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise APIError(400, "prompt must not be empty", param="prompt", code="empty_prompt")
        if self.vocab_size is not None and any(t < 0 or t >= self.vocab_size for t in token_ids):
            raise APIError(400, f"prompt token ids must be in [0, {self.vocab_size})", param="prompt")

    def chat_prompt(self, req: ChatCompletionRequest | TokenizeRequest) -> list[int]:
        messages = [
            {"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in req.messages or []
        ]
        try:
            ids = self.engine.tokenizer.apply_chat_template(
                messages, add_generation_prompt=req.add_generation_prompt, tokenize=True, return_dict=False
            )
        except Exception as exc:  # noqa: BLE001 - a template error is the caller's input
            raise APIError(400, f"cannot apply the chat template: {exc}", param="messages") from None
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        ids = list(ids)
        self.check_token_ids(ids)
        return ids

    def default_max_tokens(self, prompt_len: int) -> int:
        return max(1, self.max_model_len - min(prompt_len, self.max_input_len))

    # ------------------------------------------------------------------ submitting
    async def submit(
        self, base_id: str, prompts: list[str | list[int]], params: SamplingParams, priority: int
    ) -> list[RequestStream]:
        streams: list[RequestStream] = []
        try:
            for i, prompt in enumerate(prompts):
                request_id = base_id if len(prompts) == 1 else f"{base_id}-{i}"
                streams.append(await self.engine.add_request(request_id, prompt, params, priority))
        except BaseException:
            self.engine.abort([s.request_id for s in streams])
            raise
        return streams

    def abort_unfinished(self, streams: list[RequestStream]) -> None:
        self.engine.abort([s.request_id for s in streams if not s.finished])

    async def collect(self, request: Request, streams: list[RequestStream]) -> list[Any]:
        """Final output of each stream; aborts them all if the client goes away first."""

        async def last(stream: RequestStream) -> Any:
            final = None
            async for out in stream:
                final = out
            return final

        gathering = asyncio.ensure_future(asyncio.gather(*(last(s) for s in streams)))
        listening = asyncio.ensure_future(_wait_for_disconnect(request))
        try:
            done, _ = await asyncio.wait({gathering, listening}, return_when=asyncio.FIRST_COMPLETED)
            if gathering in done:
                return gathering.result()
            raise APIError(499, "client disconnected", code="client_closed_request")
        finally:
            listening.cancel()
            if not gathering.done():
                gathering.cancel()
            self.abort_unfinished(streams)

    async def merged(self, streams: list[RequestStream]) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, output) pairs from all streams, in the order they arrive."""
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

        async def pump(i: int, stream: RequestStream) -> None:
            try:
                async for out in stream:
                    await queue.put((i, out))
            except BaseException as exc:  # noqa: BLE001 - forwarded to the consumer
                await queue.put((i, exc))

        tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
        try:
            remaining = len(streams)
            while remaining:
                i, item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item.finished:
                    remaining -= 1
                yield i, item
        finally:
            for task in tasks:
                task.cancel()

    # ------------------------------------------------------------------ logprobs
    def _token_text(self, token_id: int) -> str:
        return self.engine.tokenizer.decode([token_id])

    def completion_logprobs(self, entries: list[Any], offset: int) -> dict[str, Any]:
        tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
        for entry in entries:
            text = self._token_text(entry.token_id)
            tokens.append(text)
            token_logprobs.append(entry.logprob)
            top_logprobs.append({self._token_text(t): lp for t, lp in entry.top.items()})
            text_offset.append(offset)
            offset += len(text)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }

    def chat_logprobs(self, entries: list[Any]) -> dict[str, Any]:
        def item(token_id: int, logprob: float) -> dict[str, Any]:
            text = self._token_text(token_id)
            return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

        return {
            "content": [
                {**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top.items()]}
                for e in entries
            ]
        }

    @staticmethod
    def _delta_logprobs(out: Any) -> list[Any]:
        if not out.logprobs:
            return []
        end = len(out.token_ids)  # the engine keeps appending to the list it handed out
        return list(out.logprobs[end - len(out.delta_token_ids) : end])

    # ------------------------------------------------------------------ /v1/completions
    async def completions(self, request: Request) -> Response:
        req: CompletionRequest = await self.parse(request, CompletionRequest)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if req.best_of not in (None, 1):
            raise APIError(400, "best_of must be 1", param="best_of")
        prompts = self._completion_prompts(req.prompt)
        params = _sampling(req, req.max_tokens if req.max_tokens is not None else 16, req.logprobs)
        request_id = random_id("cmpl")
        streams = await self.submit(request_id, prompts, params, req.priority)
        created = int(time.time())
        if req.stream:
            body = self._completion_stream(req, request_id, created, prompts, streams)
            return _AbortOnCloseResponse(body, lambda: self.abort_unfinished(streams))
        finals = await self.collect(request, streams)
        choices = []
        for i, out in enumerate(finals):
            text = out.text
            prefix = self._echo_text(prompts[i], out) if req.echo else ""
            choices.append(
                {
                    "index": i,
                    "text": prefix + text,
                    "logprobs": self.completion_logprobs(out.logprobs or [], len(prefix))
                    if req.logprobs is not None
                    else None,
                    "finish_reason": _finish_reason(out),
                    "stop_reason": out.stop_reason,
                }
            )
        usage = _usage(finals)
        return JSONResponse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": choices,
                "usage": usage.model_dump(),
            }
        )

    def _completion_prompts(self, prompt: Any) -> list[str | list[int]]:
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and all(isinstance(p, int) for p in prompt):
            prompts = [list(prompt)]
        else:
            prompts = list(prompt)
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt", code="empty_prompt")
        for p in prompts:
            if isinstance(p, str):
                if not p:
                    raise APIError(400, "prompt must not be empty", param="prompt", code="empty_prompt")
            else:
                self.check_token_ids(p)
        return prompts

    def _echo_text(self, prompt: str | list[int], out: Any) -> str:
        return prompt if isinstance(prompt, str) else self.engine.tokenizer.decode(out.prompt_token_ids)

    async def _completion_stream(
        self, req: CompletionRequest, request_id: str, created: int, prompts: list[Any], streams: list[RequestStream]
    ) -> AsyncIterator[str]:
        head = {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name}
        finals: dict[int, Any] = {}
        text_len: dict[int, int] = {}
        try:
            async for i, out in self.merged(streams):
                delta = out.delta_text
                if req.echo and i not in text_len:
                    delta = self._echo_text(prompts[i], out) + delta
                if not delta and not out.finished:
                    continue
                offset = text_len.get(i, 0)
                text_len[i] = offset + len(delta)
                choice = {
                    "index": i,
                    "text": delta,
                    "logprobs": self.completion_logprobs(self._delta_logprobs(out), offset)
                    if req.logprobs is not None
                    else None,
                    "finish_reason": _finish_reason(out) if out.finished else None,
                }
                if out.finished:
                    choice["stop_reason"] = out.stop_reason
                    finals[i] = out
                chunk = {**head, "choices": [choice]}
                if req.include_usage:
                    chunk["usage"] = None
                yield _sse(chunk)
            if req.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(finals.values()).model_dump()})
        except Exception as exc:  # noqa: BLE001 - the status line is gone; report in the stream
            yield _sse(_as_api_error(exc).body())
        yield _SSE_DONE

    # ------------------------------------------------------------------ /v1/chat/completions
    async def chat_completions(self, request: Request) -> Response:
        req: ChatCompletionRequest = await self.parse(request, ChatCompletionRequest)
        if req.tools:
            raise APIError(400, "tools are not supported", param="tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise APIError(400, "only response_format type 'text' is supported", param="response_format")
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        prompt_ids = self.chat_prompt(req)
        max_tokens = req.max_completion_tokens or req.max_tokens or self.default_max_tokens(len(prompt_ids))
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        params = _sampling(req, max_tokens, logprobs)
        request_id = random_id("chatcmpl")
        streams = await self.submit(request_id, [prompt_ids], params, req.priority)
        created = int(time.time())
        if req.stream:
            body = self._chat_stream(req, request_id, created, streams)
            return _AbortOnCloseResponse(body, lambda: self.abort_unfinished(streams))
        (out,) = await self.collect(request, streams)
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": out.text},
            "logprobs": self.chat_logprobs(out.logprobs or []) if req.logprobs else None,
            "finish_reason": _finish_reason(out),
            "stop_reason": out.stop_reason,
        }
        return JSONResponse(
            {
                "id": request_id,
                "object": "chat.completion",
                "created": created,
                "model": self.model_name,
                "choices": [choice],
                "usage": _usage([out]).model_dump(),
            }
        )

    async def _chat_stream(
        self, req: ChatCompletionRequest, request_id: str, created: int, streams: list[RequestStream]
    ) -> AsyncIterator[str]:
        head = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        usage_field = {"usage": None} if req.include_usage else {}
        finals: list[Any] = []
        try:
            first = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
            yield _sse({**head, "choices": [first], **usage_field})
            async for _, out in self.merged(streams):
                if not out.delta_text and not out.finished:
                    continue
                choice = {
                    "index": 0,
                    "delta": {"content": out.delta_text} if out.delta_text else {},
                    "logprobs": self.chat_logprobs(self._delta_logprobs(out)) if req.logprobs else None,
                    "finish_reason": _finish_reason(out) if out.finished else None,
                }
                if out.finished:
                    choice["stop_reason"] = out.stop_reason
                    finals.append(out)
                yield _sse({**head, "choices": [choice], **usage_field})
            if req.include_usage:
                yield _sse({**head, "choices": [], "usage": _usage(finals).model_dump()})
        except Exception as exc:  # noqa: BLE001 - the status line is gone; report in the stream
            yield _sse(_as_api_error(exc).body())
        yield _SSE_DONE

    # ------------------------------------------------------------------ small routes
    async def tokenize(self, request: Request) -> Response:
        req: TokenizeRequest = await self.parse(request, TokenizeRequest)
        if req.messages is not None:
            ids = self.chat_prompt(req)
        elif req.prompt is not None:
            ids = list(self.engine.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens))
        else:
            raise APIError(400, "give 'prompt' or 'messages'", param="prompt")
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len})

    async def detokenize(self, request: Request) -> Response:
        req: DetokenizeRequest = await self.parse(request, DetokenizeRequest)
        if self.vocab_size is not None and any(t < 0 or t >= self.vocab_size for t in req.tokens):
            raise APIError(400, f"token ids must be in [0, {self.vocab_size})", param="tokens")
        return JSONResponse({"prompt": self.engine.tokenizer.decode(req.tokens)})

    def models(self) -> dict[str, Any]:
        root = self.engine.config.model
        cards = [ModelCard(id=name, root=root, max_model_len=self.max_model_len) for name in self.served_model_names]
        return ModelList(data=cards).model_dump()


def _sampling(req: Any, max_tokens: int, logprobs: int | None) -> SamplingParams:
    if req.n != 1:
        raise APIError(400, f"only n=1 is supported, got {req.n}", param="n")
    try:
        return req.sampling_params(max_tokens, logprobs)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, InvalidRequestError):
            raise
        raise APIError(400, str(exc)) from None


def _finish_reason(out: Any) -> str | None:
    reason = out.finish_reason
    return None if reason is None else getattr(reason, "value", reason)


def _usage(outputs: Any) -> UsageInfo:
    outputs = list(outputs)
    return UsageInfo.of(sum(len(o.prompt_token_ids) for o in outputs), sum(len(o.token_ids) for o in outputs))


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


# ---------------------------------------------------------------------------------------------------- app
def build_app(
    engine: Any,
    *,
    served_model_name: str | Sequence[str] | None = None,
    api_key: str | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    metrics: EngineMetrics | None = None,
) -> FastAPI:
    """The FastAPI app over an LLMEngine (wrapped and owned: its loop stops with the app) or an AsyncLLMEngine
    (shared: the caller starts and stops it; the app starts it if needed)."""
    owned = not isinstance(engine, AsyncLLMEngine)
    async_engine = AsyncLLMEngine(engine) if owned else engine
    if isinstance(served_model_name, str):
        names = [served_model_name]
    elif served_model_name:
        names = list(served_model_name)
    else:
        names = [_default_model_name(async_engine.config.model)]
    metrics = metrics or EngineMetrics(model_name=names[0])
    async_engine.step_listeners.append(
        lambda eng, outputs: metrics.observe_step(eng.last_stats, getattr(eng, "last_step_time_s", None), outputs)
    )
    serving = OpenAIServing(async_engine, names, metrics, max_body_bytes)

    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        yield
        if owned:  # uvicorn has already waited for the in-flight requests (graceful shutdown)
            await asyncio.get_running_loop().run_in_executor(None, async_engine.shutdown)

    app = FastAPI(title="batchserve", lifespan=_as_context(lifespan), docs_url=None, redoc_url=None)
    app.state.serving = serving
    app.state.async_engine = async_engine
    app.state.metrics = metrics

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> Response:
        return exc.response()

    @app.exception_handler(InvalidRequestError)
    @app.exception_handler(QueueFullError)
    @app.exception_handler(EngineDeadError)
    async def _engine_error(_: Request, exc: Exception) -> Response:
        return _as_api_error(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> Response:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> Response:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return APIError(exc.status_code, str(exc.detail), type_=kind).response()

    @app.exception_handler(Exception)
    async def _internal(_: Request, exc: Exception) -> Response:
        return _as_api_error(exc).response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await serving.completions(request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await serving.chat_completions(request)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse(serving.models())

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await serving.tokenize(request)

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await serving.detokenize(request)

    @app.get("/health")
    async def health() -> Response:
        if not async_engine.is_running and async_engine.error is not None:
            return _as_api_error(EngineDeadError(f"engine loop died: {async_engine.error!r}")).response()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    return app


def _as_context(lifespan: Callable[[FastAPI], AsyncIterator[None]]) -> Any:
    import contextlib

    return contextlib.asynccontextmanager(lifespan)


def _default_model_name(model: str | None) -> str:
    return model if model else DEFAULT_MODEL_NAME


# ---------------------------------------------------------------------------------------------------- CLI
def make_parser() -> argparse.ArgumentParser:
    from batchserve.entrypoints.engine_args import add_engine_arguments

    parser = argparse.ArgumentParser(
        prog="batchserve serve", description="OpenAI-compatible HTTP server (continuous batching, paged KV cache)"
    )
    parser.add_argument(
        "model", nargs="?", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (or env BATCHSERVE_API_KEY)"
    )
    parser.add_argument(
        "--served-model-name", default=None, help="name clients use (comma-separated aliases allowed; first reported)"
    )
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="on SIGTERM wait this long for in-flight requests (default: forever)",
    )
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_arguments(parser, include_model=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    from batchserve.config import ConfigError
    from batchserve.engine.llm_engine import LLMEngine
    from batchserve.entrypoints.engine_args import engine_config_from_args

    parser = make_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or os.environ.get("BATCHSERVE_API_KEY") or None
    try:
        config = engine_config_from_args(args, **({"model": args.model} if args.model else {}))
    except ConfigError as exc:
        parser.error(str(exc))
    if not _is_loopback(args.host) and not api_key:
        logger.warning("binding %s without an API key: anyone who can reach it can use it", args.host)

    engine = LLMEngine(config)
    async_engine = AsyncLLMEngine(engine)
    names = [n.strip() for n in args.served_model_name.split(",") if n.strip()] if args.served_model_name else None
    app = build_app(async_engine, served_model_name=names, api_key=api_key, max_body_bytes=args.max_body_bytes)
    return serve(app, async_engine, args.host, args.port, args.log_level, args.drain_timeout)


def serve(
    app: FastAPI,
    async_engine: AsyncLLMEngine,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    drain_timeout: float | None = None,
) -> int:
    """Run uvicorn in this (main) thread until SIGTERM/SIGINT; in-flight requests finish first (drain)."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout)
    )
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal under the handler found at start: make that a
    # clean exit instead of death by signal.
    previous = {sig: signal.signal(sig, _exit_cleanly) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        async_engine.shutdown(drain=True)
    return 0


def _exit_cleanly(signum: int, frame: Any) -> None:
    raise SystemExit(0)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
