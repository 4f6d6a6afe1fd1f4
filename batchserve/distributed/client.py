"""RemoteEngineClient: the serving layer's EngineClient over the EngineReplica deployment's handle.

The ingress tokenizes and validates here (the serving layer builds the EngineRequest, with the engine's limits
fetched once from a replica), then each request is one streaming call `generate(ReplicaRequest)`, routed by the deployment's request
router. Its one message is the replica's admission (or its error), so a refused request is answered before any
byte of a response goes out, as on one engine; the call then stays open until the request ends (Ray Serve counts
it, and an abort cancels it). The outputs come on one `subscribe` call per replica this client has requests on,
pinned to it by the routers: a message per engine step for all of them (distributed/outbox.py), relayed into
RequestStreams the front ends read as they read a local engine's.

Failures: an error the replica raised (invalid request, queue full) comes back as itself. A replica that died or
cannot be reached (its subscription or a request's call fails) hands its requests on (distributed/migration.py):
each goes to another replica as its prompt plus the tokens it has already streamed, with the budget that is left,
and its stream carries on there, so its reader sees one stream (greedy: the same tokens as without the failure);
only a request that cannot be placed within MAX_MIGRATIONS attempts ends with ServingError(UNAVAILABLE) (HTTP 503,
or an error event in a stream), never a hang. An abort cancels the call, and the replica drops the request.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import uuid
from dataclasses import dataclass
from typing import Any

from ray.exceptions import RayError, RayTaskError
from ray.serve.exceptions import BackPressureError, RayServeException
from transformers import PreTrainedTokenizerBase

from batchserve.core.outputs import SchedulerStats
from batchserve.distributed.messages import EngineDescription, ReplicaRequest, StepOutputs, Subscribe, WrongReplica
from batchserve.distributed.metrics import REQUESTS_MOVED
from batchserve.distributed.migration import MAX_MIGRATIONS, Handover
from batchserve.engine.async_engine import RequestStream
from batchserve.engine.core_messages import DescribedEngine
from batchserve.request import EngineRequest, LoRARequest
from batchserve.serving.errors import ErrorKind, ServingError

logger = logging.getLogger(__name__)
# A moved request's admission may have been routed to the lost replica before its routers heard of the loss (the
# call then waits): after this long it is tried again, elsewhere. A live replica admits within milliseconds on a quiet
# host, but one busy with the moved load on a loaded host can take seconds: each further try waits twice as long.
MIGRATION_ADMIT_TIMEOUT_S = 3.0


class ReplicaLost(ServingError):
    def __init__(self, exc: BaseException) -> None:
        super().__init__(ErrorKind.UNAVAILABLE, f"the engine replica serving this request failed: {type(exc).__name__}")


@dataclass
class _InFlight:
    stream: RequestStream
    replica_id: str | None = None  # once admitted (None again while it moves to another replica)
    watch: asyncio.Task[None] | None = None
    handover: Handover = None  # type: ignore[assignment]  # set in __post_init__

    def __post_init__(self) -> None:
        self.handover = Handover(self.stream.request)


class RemoteEngineClient(DescribedEngine):
    def __init__(self, handle: Any, description: EngineDescription, tokenizer: PreTrainedTokenizerBase) -> None:
        """`handle`: a DeploymentHandle of the EngineReplica deployment."""
        self._handle = handle.options(stream=True)
        self.description = description
        self._tokenizer = tokenizer
        self.caller_id = uuid.uuid4().hex
        self._requests: dict[str, _InFlight] = {}
        self._subscriptions: dict[str, asyncio.Task[None]] = {}  # by replica id

    @classmethod
    async def connect(cls, handle: Any) -> RemoteEngineClient:
        """Ask a replica what its engine is (they all run the same options), and load the same tokenizer here."""
        from batchserve.models.loader import load_tokenizer, resolve_model_path

        description: EngineDescription = await handle.describe.remote()
        config = description.config
        tokenizer = await asyncio.to_thread(load_tokenizer, resolve_model_path(config.model), config.tokenizer)
        return cls(handle, description, tokenizer)

    def lora_names(self) -> tuple[str, ...]:
        """The LoRA adapters the replicas serve (their lora_modules: fixed for the application's life)."""
        return tuple(lora.lora_name for lora in self.description.loras)

    def list_loras(self) -> list[LoRARequest]:
        return list(self.description.loras)

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return self._tokenizer

    @property
    def is_running(self) -> bool:
        return True  # replicas come and go; Ray Serve keeps the deployment up

    @property
    def error(self) -> BaseException | None:
        return None

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def stats(self) -> SchedulerStats | None:
        return None  # one scheduler per replica: their stats are on /metrics, labelled by replica

    def check_capacity(self) -> None:
        return None  # each replica's queue is its own: the replica refuses (routing may find one with room)

    async def add_request(self, request: EngineRequest) -> RequestStream:
        request_id = request.request_id
        # registered before the call: the subscription may bring its first output before the admission does
        entry = self._requests[request_id] = _InFlight(RequestStream(request, asyncio.get_running_loop()))
        try:
            await self._place(entry, request)
        except BaseException:
            self._requests.pop(request_id, None)
            raise
        return entry.stream

    async def _place(self, entry: _InFlight, request: EngineRequest, timeout_s: float | None = None) -> None:
        """Admit `request` on a replica the router picks, and follow it there."""
        call = _own_call(self._handle.generate, ReplicaRequest(request, self.caller_id))
        try:
            admitted = await asyncio.wait_for(call.__anext__(), timeout_s)
        except TimeoutError as exc:
            call.cancel()
            raise ReplicaLost(exc) from None
        except BaseException as exc:
            call.cancel()
            raise _unwrapped(exc) from None
        entry.replica_id = admitted.replica_id
        self._ensure_subscription(admitted.replica_id)
        entry.watch = asyncio.ensure_future(self._watch(request.request_id, call))

    async def _migrate(self, request_id: str, entry: _InFlight, lost: BaseException) -> None:
        """Hand a request whose replica was lost to another replica (a few tries: the router may not know yet
        that the replica is gone); its stream's reader only sees the outputs go on."""
        for attempt in range(MAX_MIGRATIONS):
            if self._requests.get(request_id) is not entry:
                return  # aborted meanwhile
            try:
                timeout_s = MIGRATION_ADMIT_TIMEOUT_S * 2**attempt
                await self._place(entry, entry.handover.continuation(), timeout_s)
                REQUESTS_MOVED.labels("continue" if entry.handover.sent else "retry").inc()
                logger.info("request %s moved to replica %s after %r", request_id, entry.replica_id, lost)
                return
            except ReplicaLost as exc:
                lost = exc
                await asyncio.sleep(0.2 * (attempt + 1))
            except BaseException as exc:  # noqa: BLE001 - refused there (full queue, ...): the reader gets it
                lost = exc
                break
        self._fail(request_id, lost, migrate=False)

    async def _watch(self, request_id: str, call: Any) -> None:
        """The request's own call ends once its last output is on the way, or fails with its replica; cancelling
        it (an abort) makes the replica drop the request."""
        try:
            async for _ in call:
                pass
        except asyncio.CancelledError:
            call.cancel()
            raise
        except BaseException as exc:  # noqa: BLE001 - the stream's reader gets it
            self._fail(request_id, _unwrapped(exc))

    def _ensure_subscription(self, replica_id: str) -> None:
        task = self._subscriptions.get(replica_id)
        if task is None or task.done():
            self._subscriptions[replica_id] = asyncio.ensure_future(self._subscribe(replica_id))

    async def _subscribe(self, replica_id: str) -> None:
        """Relay the replica's step messages to the requests' streams while any of ours runs there (the replica
        ends a subscription when none does: subscribe again if one was admitted meanwhile)."""
        try:
            while self._on(replica_id):
                async for step in _own_call(self._handle.subscribe, Subscribe(self.caller_id, replica_id)):
                    self._relay(step, replica_id)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - every request there gets it
            error = _unwrapped(exc)
            for request_id in self._on(replica_id):
                self._fail(request_id, error)
        finally:
            if self._subscriptions.get(replica_id) is asyncio.current_task():
                del self._subscriptions[replica_id]

    def _on(self, replica_id: str) -> list[str]:
        return [rid for rid, entry in self._requests.items() if entry.replica_id == replica_id]

    def _relay(self, step: StepOutputs, replica_id: str) -> None:
        for out in step.outputs:
            entry = self._requests.get(out.request_id)
            if entry is None or entry.replica_id != replica_id:
                continue  # aborted here meanwhile, or a lost replica's late output of a request that moved
            entry.stream.put(entry.handover.relayed(out))
            if out.finished:
                del self._requests[out.request_id]  # its call ends by itself; the replica ends the subscription
        for request_id, exc in step.errors.items():
            self._fail(request_id, _unwrapped(exc))

    def _fail(self, request_id: str, exc: BaseException, migrate: bool = True) -> None:
        entry = self._requests.get(request_id)
        if entry is None:
            return
        replica_id = entry.replica_id
        moving = migrate and isinstance(exc, ReplicaLost) and entry.handover.moves
        if moving and replica_id is None:
            return  # already on its way to another replica
        if entry.watch is not None and entry.watch is not asyncio.current_task():
            entry.watch.cancel()  # the replica, if it is alive, drops the request (nobody would collect it)
        entry.watch, entry.replica_id = None, None
        if moving:
            asyncio.ensure_future(self._migrate(request_id, entry, exc))
        else:
            del self._requests[request_id]
            entry.stream.put(exc)
        if replica_id is not None and not self._on(replica_id):
            task = self._subscriptions.get(replica_id)
            if task is not None and task is not asyncio.current_task():
                task.cancel()  # a lost replica's subscription could wait for it forever

    def abort(self, request_ids: str | list[str]) -> None:
        for request_id in [request_ids] if isinstance(request_ids, str) else request_ids:
            entry = self._requests.pop(request_id, None)
            if entry is None:
                continue
            if entry.watch is not None:
                entry.watch.cancel()  # cancels the call: the replica aborts the request
            entry.stream.put(ServingError(ErrorKind.CANCELLED, "request aborted"))

    async def close(self) -> None:
        self.abort(list(self._requests))
        for task in list(self._subscriptions.values()):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.sleep(0)


def _own_call(method: Any, argument: Any) -> Any:
    """`method.remote(argument)` as a call of its own to Ray Serve. Outside a fresh context the call takes the Serve
    request context of the task making it (the HTTP request being served, or the one whose task started a
    subscription or a migration), and with it that request's internal id, which Serve's router keys its calls by:
    the requests of a lost replica, moved together from one subscription's task, all but one stayed unrouted until
    they timed out; and a subscription sharing its first request's id made the prefix-aware router count that
    request's end as the subscription's (its load on the replica never went back down)."""
    return contextvars.Context().run(method.remote, argument)


def _unwrapped(exc: BaseException) -> BaseException:
    """What the replica raised, for the serving layer to classify; anything Ray itself raised (a dead or
    unreachable replica) as ReplicaLost."""
    if isinstance(exc, WrongReplica):  # Ray may hand the replica's exception over as it is
        return ReplicaLost(exc)
    if isinstance(exc, RayTaskError):
        cause = exc.cause
        if isinstance(cause, RayError | WrongReplica):
            return ReplicaLost(cause)
        return cause if isinstance(cause, Exception) else ReplicaLost(exc)
    if isinstance(exc, BackPressureError):
        return ServingError(ErrorKind.OVERLOADED, "every engine replica is at max_ongoing_requests")
    if isinstance(exc, RayError | RayServeException):
        logger.warning("engine replica call failed: %r", exc)
        return ReplicaLost(exc)
    return exc
