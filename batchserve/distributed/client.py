"""RemoteEngineClient: the serving layer's EngineClient over the EngineReplica deployment's handle.

The ingress tokenizes and validates here (the serving layer does, with the engine's limits fetched once from a
replica), then each request is one streaming call `generate(ReplicaRequest)`, routed by the deployment's request
router. Its first message is the replica's admission (or its error), so a refused request is answered before any
byte of a response goes out, as on one engine; the rest is relayed into a RequestStream the front ends read as
they read a local engine's.

Failures: an error the replica raised (invalid request, queue full) comes back as itself; a replica that died or
cannot be reached ends the request with ServingError(UNAVAILABLE) (HTTP 503, or an error event in a stream),
never a hang. An abort cancels the call, and the replica drops the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import BackPressureError, RayServeException
from transformers import PreTrainedTokenizerBase

from batchserve.config import EngineConfig
from batchserve.core.outputs import SchedulerStats
from batchserve.distributed.messages import EngineDescription, ReplicaRequest
from batchserve.engine.async_engine import RequestStream
from batchserve.engine.inputs import EngineLimits, Prompt
from batchserve.sampling_params import SamplingParams
from batchserve.serving.errors import ErrorKind, ServingError

logger = logging.getLogger(__name__)


class ReplicaLost(ServingError):
    def __init__(self, exc: BaseException) -> None:
        super().__init__(ErrorKind.UNAVAILABLE, f"the engine replica serving this request failed: {type(exc).__name__}")


class RemoteEngineClient:
    def __init__(self, handle: Any, description: EngineDescription, tokenizer: PreTrainedTokenizerBase) -> None:
        """`handle`: a DeploymentHandle of the EngineReplica deployment."""
        self._handle = handle.options(stream=True)
        self.description = description
        self._tokenizer = tokenizer
        self._calls: dict[str, tuple[Any, asyncio.Task[None], RequestStream]] = {}

    @classmethod
    async def connect(cls, handle: Any) -> RemoteEngineClient:
        """Ask a replica what its engine is (they all run the same options), and load the same tokenizer here."""
        from batchserve.models.loader import load_tokenizer, resolve_model_path

        description: EngineDescription = await handle.describe.remote()
        config = description.config
        tokenizer = await asyncio.to_thread(load_tokenizer, resolve_model_path(config.model), config.tokenizer)
        return cls(handle, description, tokenizer)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def config(self) -> EngineConfig:
        return self.description.config

    @property
    def limits(self) -> EngineLimits:
        return self.description.limits

    @property
    def is_running(self) -> bool:
        return True  # replicas come and go; Ray Serve keeps the deployment up

    @property
    def error(self) -> BaseException | None:
        return None

    @property
    def num_in_flight(self) -> int:
        return len(self._calls)

    def stats(self) -> SchedulerStats | None:
        return None  # one scheduler per replica: their stats are on /metrics, labelled by replica

    async def add_request(
        self, request_id: str, prompt: Prompt, params: SamplingParams, priority: int = 0
    ) -> RequestStream:
        call = self._handle.generate.remote(ReplicaRequest(request_id, prompt, params, priority))
        try:
            await call.__anext__()  # the replica admitted it
        except BaseException as exc:
            call.cancel()
            raise _unwrapped(exc) from None
        stream = RequestStream(request_id, asyncio.get_running_loop())
        relay = asyncio.ensure_future(self._relay(call, stream))
        self._calls[request_id] = (call, relay, stream)
        relay.add_done_callback(lambda _: self._calls.pop(request_id, None))
        return stream

    async def _relay(self, call: Any, stream: RequestStream) -> None:
        prompt: tuple[str | None, list[int]] | None = None
        try:
            async for outputs in call:
                for out in outputs:
                    if prompt is None:
                        prompt = (out.prompt, out.prompt_token_ids)
                    elif not out.prompt_token_ids:  # sent once: every output carries it again here
                        out.prompt, out.prompt_token_ids = prompt
                    stream.put(out)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - the stream's reader gets it
            stream.put(_unwrapped(exc))

    def abort(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            entry = self._calls.pop(request_id, None)
            if entry is None:
                continue
            call, relay, stream = entry
            call.cancel()  # the replica's generator is cancelled: its engine aborts the request
            relay.cancel()
            stream.put(ServingError(ErrorKind.CANCELLED, "request aborted"))

    async def close(self) -> None:
        self.abort(list(self._calls))
        with contextlib.suppress(Exception):
            await asyncio.sleep(0)


def _unwrapped(exc: BaseException) -> BaseException:
    """What the replica raised, for the serving layer to classify; anything Ray itself raised (a dead or
    unreachable replica) as ReplicaLost."""
    if isinstance(exc, RayTaskError):
        cause = exc.cause
        if isinstance(cause, RayError):
            return ReplicaLost(cause)
        return cause if isinstance(cause, Exception) else ReplicaLost(exc)
    if isinstance(exc, BackPressureError):
        return ServingError(ErrorKind.OVERLOADED, "every engine replica is at max_ongoing_requests")
    if isinstance(exc, RayError | RayServeException):
        logger.warning("engine replica call failed: %r", exc)
        return ReplicaLost(exc)
    return exc
