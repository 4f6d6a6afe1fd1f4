"""What the OpenAI routes share: the serving layer, the served model names, body parsing and sampling options."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel
from starlette.requests import ClientDisconnect

from batchserve.entrypoints.openai.bodies import OFF_LOOP_BODY_BYTES, BodyParser, validated_body
from batchserve.entrypoints.openai.errors import APIError
from batchserve.entrypoints.openai.protocol import SamplingRequest, UsageInfo
from batchserve.sampling_params import InvalidRequestError, SamplingParams
from batchserve.serving.generation import GenerationService
from batchserve.serving.results import GenerationResult, Usage

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024

Body = TypeVar("Body", bound=BaseModel)
T = TypeVar("T")

logger = logging.getLogger(__name__)


class OpenAIFrontEnd:
    def __init__(
        self, service: GenerationService, served_model_names: Sequence[str], max_body_bytes: int, lenient: bool = False
    ) -> None:
        """lenient: fields the server does not act on are dropped with a logged warning instead of answered 400."""
        self.service = service
        self.served_model_names = list(served_model_names)
        self.model_name = self.served_model_names[0]
        self.max_body_bytes = max_body_bytes
        self.lenient = lenient
        # chat output parsing (serve --tool-call-parser / --reasoning-parser / --chat-template): None is the default
        self.tool_call_parser: str | None = None  # None: the family the chat template writes calls in
        self.reasoning_parser: str | None = None  # None: no reasoning_content
        self.chat_template: str | None = None  # a template's text in place of the model's
        # /detokenize decodes on worker threads one at a time: those threads hold the GIL, and several at once
        # would each take a turn before the event loop got its next one
        self._off_loop = asyncio.Semaphore(1)
        self.body_parser = BodyParser()  # large bodies: parsed in a process of their own (bodies.py)
        # the LoRA adapters served now (a snapshot the engine keeps; lora_routes.py sets it where there are any)
        self.adapter_names: Callable[[], Sequence[str]] = tuple

    async def parse(self, request: Request, model: type[Body]) -> Body:
        """The body as `model`: 413 over the size limit, 400 for malformed JSON, invalid fields or another model."""
        length = request.headers.get("content-length")
        if length is not None:
            try:
                too_big = int(length) > self.max_body_bytes
            except ValueError:
                raise APIError(400, "invalid Content-Length header", code="invalid_header") from None
            if too_big:
                raise self._too_big()
        body = bytearray()
        try:
            async for chunk in request.stream():
                body += chunk
                if len(body) > self.max_body_bytes:
                    raise self._too_big()
        except ClientDisconnect:  # gone mid-body: nobody to answer, and no fault of the server's to log
            raise APIError(499, "the client closed the connection before its body arrived",
                           code="client_closed_request") from None  # fmt: skip
        if len(body) > OFF_LOOP_BODY_BYTES:  # a large body's parse would hold up every other connection
            parsed = await self.body_parser.parse(bytes(body), model, self.lenient)
        else:
            parsed = validated_body(bytes(body), model, self.lenient)
        self.check_model(getattr(parsed, "model", None))
        return parsed

    async def off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on a worker thread, one such call at a time."""
        async with self._off_loop:
            return await asyncio.to_thread(work, *args)

    def _too_big(self) -> APIError:
        return APIError(413, f"request body is over {self.max_body_bytes} bytes", code="body_too_large")

    def check_model(self, name: str | None) -> None:
        """404 for a model this server does not serve (neither the base model nor an adapter), as OpenAI and vLLM
        answer."""
        if name is not None and name not in self.served_model_names and name not in self.adapter_names():
            raise self.model_not_found(name)

    def model_not_found(self, name: str) -> APIError:
        adapters = self.adapter_names()
        also = f" and the LoRA adapters {', '.join(map(repr, adapters))}" if adapters else ""
        return APIError(
            404,
            f"the model '{name}' does not exist; this server serves {self.model_name!r}{also}",
            type_="not_found_error",
            param="model",
            code="model_not_found",
        )

    def with_adapter(self, params: SamplingParams, model: str | None) -> SamplingParams:
        """The request's sampling parameters with its adapter, when its `model` names one."""
        if model is None or model in self.served_model_names:
            return params
        return dataclasses.replace(params, lora_name=model)


def sampling_params(req: SamplingRequest, max_tokens: int, logprobs: int | None) -> SamplingParams:
    try:
        return req.sampling_params(max_tokens, logprobs)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, InvalidRequestError):
            raise
        raise APIError(400, str(exc)) from None


def finish_fields(result: GenerationResult) -> dict[str, str | int | None]:
    """A choice's finish_reason, and vLLM's stop_reason once it has one."""
    if not result.finished:
        return {"finish_reason": None}
    return {"finish_reason": result.finish_reason, "stop_reason": result.stop_reason}


def chunk_usage(req: SamplingRequest, result: GenerationResult) -> dict[str, object]:
    """A stream chunk's usage field: absent unless asked for; null until the last chunk, or with
    stream_options.continuous_usage_stats (vLLM's) this choice's usage so far."""
    if not req.include_usage:
        return {}
    if req.stream_options is not None and req.stream_options.continuous_usage_stats:
        return {"usage": UsageInfo.of(Usage.of([result]))}
    return {"usage": None}
