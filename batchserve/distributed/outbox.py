"""Outbox: one caller's requests on an engine replica, whose outputs leave as one message per engine step.

A replica streaming each request's outputs on that request's own Ray call sends a Ray message per request per step
(~50 a step at batch 50), and every one of them wakes threads in the replica and in the ingress, which on a small
machine preempt the engine's own threads. So each request's `generate` call only admits it and ends with it; its
outputs go to the caller's one `subscribe` call on that replica, gathered over every request of that caller:
one message per step (or fewer, when the caller reads slower than the engine steps).

Runs on the replica's event loop; the engine hands a step's outputs over in one callback, so a collect sees all of
them at once.
"""

from __future__ import annotations

import asyncio

from batchserve.distributed.messages import StepOutputs
from batchserve.engine.async_engine import RequestStream


class Outbox:
    def __init__(self) -> None:
        self._streams: dict[str, RequestStream] = {}
        self._ended: dict[str, asyncio.Future[None]] = {}  # resolved once the request's last output is collected
        self._wake = asyncio.Event()
        self._subscriber = 0  # the token of the subscription that collects; a newer one replaces it
        self._subscriptions = 0  # open ones (an old one may still be returning)

    @property
    def idle(self) -> bool:
        return not self._streams

    @property
    def unused(self) -> bool:
        """No request in flight and no subscription open: the replica may forget this outbox."""
        return not self._streams and not self._subscriptions

    def add(self, stream: RequestStream) -> asyncio.Future[None]:
        """Collect `stream`'s outputs from now on; the future resolves once its last output (or its error) is."""
        self._streams[stream.request_id] = stream
        ended = self._ended[stream.request_id] = asyncio.get_running_loop().create_future()
        stream.listener = self._wake.set
        self._wake.set()  # outputs may have arrived before the listener was set
        return ended

    def discard(self, request_id: str) -> None:
        """The request was aborted: whatever it still produces is not sent."""
        self._end(request_id, aborted=True)
        self._wake.set()  # a subscriber waiting for it re-checks (and ends, if it was the last)

    def subscribe(self) -> int:
        """A token for a new subscriber (an older one stops at its next wake-up); `unsubscribe` when it ends."""
        self._subscriber += 1
        self._subscriptions += 1
        self._wake.set()
        return self._subscriber

    def unsubscribe(self) -> None:
        self._subscriptions -= 1

    def current(self, token: int) -> bool:
        return token == self._subscriber

    async def next(self, token: int) -> StepOutputs | None:
        """The outputs collected since the last call, waiting for some; None when there is nothing left to send
        (no request in flight) or a newer subscriber took over."""
        while self.current(token):
            step = self.collect()
            if step is not None:
                return step
            if self.idle:
                return None
            self._wake.clear()
            await self._wake.wait()
        return None

    def collect(self) -> StepOutputs | None:
        """What every stream holds now, without waiting; None if nothing (deltas only: the caller has the prompt)."""
        step = StepOutputs()
        for request_id, stream in list(self._streams.items()):
            try:
                outputs = stream.ready()
            except BaseException as exc:  # noqa: BLE001 - the request's error goes to the caller
                step.errors[request_id] = exc
                self._end(request_id)
                continue
            step.outputs += outputs
            if stream.finished:
                self._end(request_id)
        return step if step.outputs or step.errors else None

    def _end(self, request_id: str, aborted: bool = False) -> None:
        self._streams.pop(request_id, None)
        ended = self._ended.pop(request_id, None)
        if ended is not None and not ended.done():
            ended.cancel() if aborted else ended.set_result(None)
