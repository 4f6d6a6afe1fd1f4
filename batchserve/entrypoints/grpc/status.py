"""The one place where a failure becomes a gRPC status: the serving layer's ErrorKind -> grpc.StatusCode, for both
gRPC services (batchserve.v1.Generation and KServe's GRPCInferenceService)."""

from __future__ import annotations

from typing import NoReturn

import grpc

from batchserve.serving.errors import ErrorKind, ServingError, classify

RETRY_AFTER_S = 1

STATUS_OF_KIND: dict[ErrorKind, grpc.StatusCode] = {
    ErrorKind.INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorKind.NOT_FOUND: grpc.StatusCode.NOT_FOUND,
    ErrorKind.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,  # the waiting queue is full: retry later
    ErrorKind.UNAVAILABLE: grpc.StatusCode.UNAVAILABLE,
    ErrorKind.CANCELLED: grpc.StatusCode.CANCELLED,
    ErrorKind.TIMEOUT: grpc.StatusCode.DEADLINE_EXCEEDED,
    ErrorKind.INTERNAL: grpc.StatusCode.INTERNAL,
}


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str, ServingError]:
    """The status code and message a gRPC caller gets for `exc` (engine errors classified by the serving layer)."""
    error = classify(exc)
    message = f"{error.param}: {error.message}" if error.param and error.param not in error.message else error.message
    return STATUS_OF_KIND[error.kind], message, error


async def abort_rpc(context: grpc.aio.ServicerContext, exc: BaseException) -> NoReturn:
    """End the RPC with the status of `exc` (raises, as context.abort does). A full queue also says when to retry,
    as the HTTP server's Retry-After does."""
    code, message, error = grpc_status(exc)
    trailers = (("retry-after", str(RETRY_AFTER_S)),) if error.kind == ErrorKind.OVERLOADED else ()
    await context.abort(code, message, trailing_metadata=trailers)
    raise AssertionError("context.abort returns only by raising")  # pragma: no cover


def invalid(message: str, param: str | None = None) -> ServingError:
    return ServingError(ErrorKind.INVALID_REQUEST, message, param)


def not_found(message: str) -> ServingError:
    return ServingError(ErrorKind.NOT_FOUND, message)
