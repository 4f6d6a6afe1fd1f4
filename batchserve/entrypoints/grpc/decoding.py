"""A request message that cannot be decoded (a string field that is not valid UTF-8, truncated bytes) is the
caller's error: INVALID_ARGUMENT, as HTTP answers 400. grpc's own answer is INTERNAL ("Exception deserializing
request"), which reads as the server's fault; this interceptor decodes leniently and refuses in the handler."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

INVALID_MESSAGE = "the request message cannot be decoded (a string field that is not valid UTF-8?): {reason}"


@dataclass(frozen=True)
class _Undecodable:
    reason: str


class DecodeErrorInterceptor(grpc.aio.ServerInterceptor):
    """On the services named in `services` (prefixes of their methods): grpc's health and reflection services keep
    their own handlers."""

    def __init__(self, services: tuple[str, ...]) -> None:
        self._prefixes = tuple(f"/{name}/" for name in services)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not details.method.startswith(self._prefixes) or handler.request_deserializer is None:
            return handler
        return _lenient(handler)


def _lenient(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    decode = handler.request_deserializer

    def lenient_decode(data: bytes) -> Any:
        try:
            return decode(data)
        except Exception as exc:  # noqa: BLE001 - protobuf's DecodeError, or whatever a deserializer raises
            return _Undecodable(str(exc) or type(exc).__name__)

    codec = {"request_deserializer": lenient_decode, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        behavior = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await _refuse_if_undecodable(request, context)
            return await behavior(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, **codec)
    if handler.unary_stream:
        streaming = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            await _refuse_if_undecodable(request, context)
            async for response in streaming(request, context):
                yield response

        return grpc.unary_stream_rpc_method_handler(unary_stream, **codec)
    if handler.stream_unary:
        gathering = handler.stream_unary

        async def stream_unary(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> Any:
            return await gathering(_checked(requests, context), context)

        return grpc.stream_unary_rpc_method_handler(stream_unary, **codec)
    both = handler.stream_stream

    async def stream_stream(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        async for response in both(_checked(requests, context), context):
            yield response

    return grpc.stream_stream_rpc_method_handler(stream_stream, **codec)


async def _checked(requests: AsyncIterator[Any], context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
    async for request in requests:
        await _refuse_if_undecodable(request, context)
        yield request


async def _refuse_if_undecodable(request: Any, context: grpc.aio.ServicerContext) -> None:
    if isinstance(request, _Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, INVALID_MESSAGE.format(reason=request.reason))
