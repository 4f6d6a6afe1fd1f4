"""The API key on gRPC: metadata `authorization: Bearer <key>` on every service but grpc.health.v1.Health (the
counterpart of the HTTP server's open /health), compared in constant time."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc

from batchserve.entrypoints.api_key import api_key_matches

OPEN_SERVICES = ("/grpc.health.v1.Health/",)
UNAUTHENTICATED_MESSAGE = "invalid or missing API key (metadata 'authorization: Bearer <key>')"


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, api_key: str) -> None:
        self._api_key = api_key.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_SERVICES) or self._authorized(details):
            return handler
        return _refusing(handler)

    def _authorized(self, details: grpc.HandlerCallDetails) -> bool:
        given = next((v for k, v in details.invocation_metadata or () if k == "authorization"), "")
        return api_key_matches(given if isinstance(given, bytes) else str(given), self._api_key)


def _refusing(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape (unary or streaming, each side) as `handler` that answers UNAUTHENTICATED."""

    async def refuse(_request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    codec = {"request_deserializer": handler.request_deserializer, "response_serializer": handler.response_serializer}
    if handler.unary_unary:
        return grpc.unary_unary_rpc_method_handler(refuse, **codec)
    if handler.unary_stream:
        return grpc.unary_stream_rpc_method_handler(refuse, **codec)
    if handler.stream_unary:
        return grpc.stream_unary_rpc_method_handler(refuse, **codec)
    return grpc.stream_stream_rpc_method_handler(refuse, **codec)
