"""Repeat offenders wait on gRPC too: an RPC aborted with a caller's-fault status (the counterparts of HTTP's 4xx)
counts against its peer in the HTTP server's offender table, and past the free refusals the abort waits for the
delay before its status goes out (entrypoints/openai/error_delay.py; grpc sends the status as soon as `abort` is
called, so the wait comes before it). RPCs that succeed, and RESOURCE_EXHAUSTED (a full
queue), CANCELLED, DEADLINE_EXCEEDED, UNAVAILABLE and INTERNAL, never wait."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from batchserve.entrypoints.openai.error_delay import OffenderTable

REFUSALS = frozenset({
    grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION,
})  # fmt: skip


class ErrorDelayInterceptor(grpc.aio.ServerInterceptor):
    """Outermost of the server's interceptors, so that the API key's refusals and undecodable requests count too."""

    def __init__(self, offenders: OffenderTable) -> None:
        self.offenders = offenders

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not (handler.unary_unary or handler.unary_stream):
            return handler  # the services here take one request per call; others pass untouched
        return self._delaying(handler)

    def _delaying(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        codec = {"request_deserializer": handler.request_deserializer,
                 "response_serializer": handler.response_serializer}  # fmt: skip
        offenders = self.offenders
        if handler.unary_unary:
            behavior = handler.unary_unary

            async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
                return await behavior(request, _DelayedAbort(context, offenders))

            return grpc.unary_unary_rpc_method_handler(unary_unary, **codec)
        streaming = handler.unary_stream

        async def unary_stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async for response in streaming(request, _DelayedAbort(context, offenders)):
                yield response

        return grpc.unary_stream_rpc_method_handler(unary_stream, **codec)


class _DelayedAbort:
    """The call's context, whose `abort` with a refusal's status first waits for the offender's delay."""

    def __init__(self, context: grpc.aio.ServicerContext, offenders: OffenderTable) -> None:
        self._context = context
        self._offenders = offenders

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)

    async def abort(self, code: grpc.StatusCode, details: str = "", trailing_metadata: Any = ()) -> None:
        if code in REFUSALS:
            delay = self._offenders.refused(peer_address(self._context.peer()))
            if delay > 0:
                await asyncio.sleep(delay)
        await self._context.abort(code, details, trailing_metadata)


def peer_address(peer: str | None) -> str | None:
    """The address in grpc's peer string ("ipv4:127.0.0.1:5000", "ipv6:[::1]:5000"), without its port; the
    HTTP server's table keys clients the same way."""
    if not peer or ":" not in peer:
        return peer or None
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rpartition(":")[0].strip("[]")
    if kind == "ipv4":
        return rest.rpartition(":")[0]
    return rest
