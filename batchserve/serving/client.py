"""EngineClient: everything a front end (HTTP, gRPC, a Ray replica) may ask of a running engine."""

from __future__ import annotations

from typing import Protocol

from transformers import PreTrainedTokenizerBase

from batchserve.config import EngineConfig
from batchserve.core.outputs import SchedulerStats
from batchserve.engine.async_engine import RequestStream
from batchserve.engine.inputs import EngineLimits
from batchserve.request import EngineRequest


class EngineClient(Protocol):
    """Implemented by batchserve.engine.async_engine.AsyncLLMEngine and, over Ray, distributed.client."""

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase: ...

    @property
    def config(self) -> EngineConfig: ...

    @property
    def limits(self) -> EngineLimits: ...

    @property
    def is_running(self) -> bool: ...

    @property
    def error(self) -> BaseException | None: ...

    async def add_request(self, request: EngineRequest) -> RequestStream:
        """The request as the serving layer built it (checked there); raises InvalidRequestError (an id in use),
        QueueFullError or EngineDeadError; else the stream of the request's deltas."""
        ...

    def check_capacity(self) -> None:
        """QueueFullError if a request added now would be refused for a full waiting queue; cheap and without
        waiting (asked before a prompt is tokenized). A client that cannot tell answers nothing."""
        ...

    def abort(self, request_ids: str | list[str]) -> None: ...

    def stats(self) -> SchedulerStats | None: ...
