"""What the OpenAI routes share: the serving layer, the served model names, body parsing and sampling options."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError
from starlette.requests import ClientDisconnect

from batchserve.entrypoints.openai.errors import APIError, validation_error
from batchserve.entrypoints.openai.protocol import SamplingRequest, UsageInfo
from batchserve.sampling_params import InvalidRequestError, SamplingParams
from batchserve.serving.generation import GenerationService
from batchserve.serving.results import GenerationResult, Usage

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
OFF_LOOP_BODY_BYTES = 64 * 1024  # bodies larger than this are parsed on a worker thread

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
        # large bodies are parsed (and /detokenize decoded) on worker threads one at a time: those threads hold the
        # GIL, and several at once would each take a turn before the event loop got its next one
        self._off_loop = asyncio.Semaphore(1)
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
            parsed = await self.off_loop(self._validated, bytes(body), model)
        else:
            parsed = self._validated(bytes(body), model)
        self.check_model(getattr(parsed, "model", None))
        return parsed

    async def off_loop(self, work: Callable[..., T], *args: Any) -> T:
        """`work(*args)` on a worker thread, one such call at a time."""
        async with self._off_loop:
            return await asyncio.to_thread(work, *args)

    def _validated(self, body: bytes, model: type[Body]) -> Body:
        data = _json(body)
        try:
            return model.model_validate(data)
        except ValidationError as exc:
            if not self.lenient:
                raise validation_error(exc) from None
            return _validate_without_unknown_fields(model, data, exc)

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


def _validate_without_unknown_fields(model: type[Body], data: object, exc: ValidationError) -> Body:
    """--lenient: the body without the fields the server would not act on, each named in a warning; any other
    error still answers 400."""
    dropped = []
    for error in exc.errors():
        if error["type"] == "extra_forbidden" and _drop(data, error["loc"]):
            dropped.append(".".join(str(part) for part in error["loc"]))
    if dropped:
        logger.warning("ignoring request field(s) this server does not act on (--lenient): %s", ", ".join(dropped))
    try:
        return model.model_validate(data)
    except ValidationError as again:
        raise validation_error(again) from None


def _drop(data: object, loc: tuple[int | str, ...]) -> bool:
    """Delete the field at `loc` from the JSON value; False when the path does not lead to it (a union's tag)."""
    for part in loc[:-1]:
        try:
            data = data[part]  # type: ignore[index]
        except (KeyError, IndexError, TypeError):
            return False
    if isinstance(data, dict) and loc and loc[-1] in data:
        del data[loc[-1]]
        return True
    return False


def _json(body: bytes) -> object:
    """The body's JSON value; 400 for malformed JSON, NaN or Infinity, nesting past Python's recursion limit, or
    a lone surrogate (\\ud800), which no tokenizer or response could encode."""
    try:
        data = json.loads(body, parse_constant=_refuse_constant)
        if _MAY_HOLD_SURROGATE.search(body):  # the full check only when the bytes could make one (a cheap scan)
            json.dumps(data, ensure_ascii=False).encode()
    except RecursionError:
        raise APIError(400, "the JSON body is nested too deeply", code="invalid_json") from None
    except UnicodeEncodeError:
        raise APIError(400, "the JSON body holds a lone surrogate (not valid Unicode)", code="invalid_json") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise APIError(400, f"malformed JSON body: {exc}", code="invalid_json") from None
    return data


# what json.loads can turn into a lone surrogate: a \uD800-\uDFFF escape, UTF-8 bytes of one (it decodes with
# surrogatepass), or a UTF-16/32 body (NUL bytes, which UTF-8 JSON cannot hold)
_MAY_HOLD_SURROGATE = re.compile(rb"\\u[dD][89a-fA-F]|\xed[\xa0-\xbf]|\x00")


def _refuse_constant(name: str) -> object:
    raise ValueError(f"{name} is not a number JSON allows")


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
