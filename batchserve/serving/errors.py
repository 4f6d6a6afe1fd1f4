"""Engine failures as protocol-neutral kinds: each front end maps a kind to its own status (HTTP 400 / gRPC
INVALID_ARGUMENT, ...), so every front end answers the same failure the same way."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass

from batchserve.core.slo import SloUnattainableError
from batchserve.engine.errors import EngineDeadError, QueueFullError
from batchserve.engine.lora_registry import UnknownAdapterError
from batchserve.sampling_params import InvalidRequestError

logger = logging.getLogger(__name__)


class ErrorKind(enum.StrEnum):
    INVALID_REQUEST = "invalid_request"  # the caller's input can never be served as asked
    NOT_FOUND = "not_found"  # an unknown model or route
    OVERLOADED = "overloaded"  # the waiting queue is full: retry later
    UNAVAILABLE = "unavailable"  # the engine is not running
    CANCELLED = "cancelled"  # the caller went away first
    TIMEOUT = "timeout"  # the request's deadline passed first: it was ended and its blocks freed
    INTERNAL = "internal"  # a bug: logged with its traceback


@dataclass
class ServingError(Exception):
    kind: ErrorKind
    message: str
    param: str | None = None  # the request field the error is about, when known
    retry_after_s: float | None = None  # overloaded: when a retry may succeed, when the engine could tell

    def __str__(self) -> str:
        return self.message

    def __reduce__(self) -> tuple[type, tuple[ErrorKind, str, str | None, float | None]]:  # pickled whole (Ray)
        return ServingError, (self.kind, self.message, self.param, self.retry_after_s)


def classify(exc: BaseException) -> ServingError:
    """What went wrong, in the words every front end shares."""
    if isinstance(exc, ServingError):
        return exc
    if isinstance(exc, UnknownAdapterError):  # a request's `model` names no adapter served (any more)
        return ServingError(ErrorKind.NOT_FOUND, str(exc), exc.param)
    if isinstance(exc, InvalidRequestError):
        return ServingError(ErrorKind.INVALID_REQUEST, str(exc), exc.param)
    if isinstance(exc, SloUnattainableError):
        return ServingError(ErrorKind.OVERLOADED, f"server overloaded, retry later: {exc}", None, exc.retry_after_s)
    if isinstance(exc, QueueFullError):
        return ServingError(ErrorKind.OVERLOADED, f"server overloaded, retry later: {exc}")
    if isinstance(exc, EngineDeadError):
        return ServingError(ErrorKind.UNAVAILABLE, str(exc))
    logger.error("internal error", exc_info=exc)
    return ServingError(ErrorKind.INTERNAL, f"internal error: {type(exc).__name__}")
