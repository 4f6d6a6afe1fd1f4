"""EngineReplica: the body of one Ray Serve replica, an AsyncLLMEngine of its own.

Ray Serve calls `generate` through a deployment handle (streaming) for each request: it admits the request and
ends with it, while the request's outputs go out on its caller's one `subscribe` call to this replica, gathered
over all of that caller's requests (distributed/outbox.py): one Ray message per engine step, not one per request
and step. It reports its load to the routers (`record_routing_stats`) and to the
autoscaler (`record_autoscaling_stats`), its Prometheus metrics riding on the routers' report for the ingress's
/metrics (distributed/metrics.py), and fails Serve's health check when its engine loop died or stalled (Serve then
replaces it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from batchserve.config import EngineConfig
from batchserve.distributed.dashboard import dashboard_report
from batchserve.distributed.messages import (
    Admitted,
    EngineDescription,
    ReplicaLoadReport,
    ReplicaRequest,
    StepOutputs,
    Subscribe,
    WrongReplica,
)
from batchserve.distributed.metrics import metrics_report
from batchserve.distributed.outbox import Outbox
from batchserve.engine.async_engine import AsyncLLMEngine, EngineDeadError
from batchserve.engine.llm_engine import LLMEngine
from batchserve.entrypoints.engine_options import engine_config
from batchserve.host.process import configure_torch
from batchserve.serving.live_stats import LiveStats
from batchserve.serving.metrics import EngineMetrics

logger = logging.getLogger(__name__)


class EngineReplica:
    async def __init__(self, engine_options: dict[str, Any], model_name: str, stall_timeout_s: float = 120.0) -> None:
        """`engine_options`: engine options as in a --config file. Async so that Ray Serve's event loop keeps
        answering (health checks) while the engine is built in a worker thread."""
        config = engine_config(engine_options, "the Ray Serve app")
        self.engine = await asyncio.to_thread(_started_engine, config)
        self.metrics = EngineMetrics(model_name=model_name).attach(self.engine)
        self.live_stats = LiveStats().attach(self.engine)  # for the ingress's /dashboard
        self.stall_timeout_s = stall_timeout_s
        self.replica_id = _replica_id()
        self._outboxes: dict[str, Outbox] = {}  # by caller
        logger.info("replica %s ready: %s", self.replica_id, self.engine.engine.effective_config())

    def describe(self) -> EngineDescription:
        engine = self.engine.engine
        return EngineDescription(
            self.engine.config, self.engine.limits, engine.runner.num_kv_blocks, engine.effective_config(),
            tuple(engine.list_loras()),
        )  # fmt: skip

    async def generate(self, request: ReplicaRequest) -> AsyncIterator[Admitted]:
        """Admits the request (or raises its error: InvalidRequestError, QueueFullError, EngineDeadError), answers
        Admitted, and ends once its last output went to the caller's outbox; its outputs go out on the caller's
        subscription. Cancelled by the caller (a client gone, an abort): the engine drops the request."""
        # arrival re-stamped in this process's clock: the ingress's monotonic clock may be another host's
        arrived = dataclasses.replace(request.request, arrival_time=time.monotonic())
        stream = await self.engine.add_request(arrived)
        outbox = self._outboxes.setdefault(request.caller, Outbox())
        ended = outbox.add(stream)
        try:
            yield Admitted(self.replica_id)
            await ended
        finally:
            if not stream.finished:
                outbox.discard(request.request_id)
                self.engine.abort(request.request_id)
            self._drop_if_unused(request.caller)

    async def subscribe(self, subscription: Subscribe) -> AsyncIterator[StepOutputs]:
        """The outputs of the caller's requests here, one message per engine step, until none is in flight (the
        caller subscribes again with its next request) or the caller subscribed anew."""
        if subscription.replica_id != self.replica_id:
            raise WrongReplica(f"subscription for replica {subscription.replica_id} reached {self.replica_id}")
        outbox = self._outboxes.setdefault(subscription.caller, Outbox())
        token = outbox.subscribe()
        try:
            while (step := await outbox.next(token)) is not None:
                yield step
        finally:
            outbox.unsubscribe()
            self._drop_if_unused(subscription.caller)

    def _drop_if_unused(self, caller: str) -> None:
        outbox = self._outboxes.get(caller)
        if outbox is not None and outbox.unused:
            del self._outboxes[caller]

    def load(self) -> ReplicaLoadReport:
        registry = self.engine.engine.loras
        loras = registry.loaded_names() if registry is not None else ()
        stats = self.engine.stats()
        if stats is None:
            return ReplicaLoadReport(num_waiting=self.engine.num_active_requests, loras=loras)
        return ReplicaLoadReport(stats.num_running, stats.num_waiting, stats.kv_usage, loras)

    def record_routing_stats(self) -> dict[str, Any]:
        """Called by Ray Serve every request_routing_stats_period_s; the routers read it as replica.routing_stats:
        the load, the rendered metrics for the ingress's /metrics and a dashboard snapshot for its /dashboard."""
        return {**self.load().as_dict(), **metrics_report(self.metrics_text()), **dashboard_report(self.live_stats)}

    def record_autoscaling_stats(self) -> dict[str, float]:
        """Called by Ray Serve for the autoscaling policy (distributed/autoscaling.py)."""
        load = self.load()
        return {"engine_requests": float(load.queue_len), "kv_usage": load.kv_usage}

    def check_health(self) -> None:
        """Ray Serve restarts the replica when this raises."""
        if not self.engine.is_running:
            raise EngineDeadError(f"engine loop is not running: {self.engine.error!r}")
        stalled = self.engine.stalled_for()
        if stalled > self.stall_timeout_s:
            raise EngineDeadError(f"the engine loop has made no progress for {stalled:.0f} s with requests pending")

    def metrics_text(self) -> str:
        return self.metrics.render().decode()

    def __del__(self) -> None:
        """Ray Serve calls this when it stops the replica."""
        self.engine.shutdown(drain=False)


def _started_engine(config: EngineConfig) -> AsyncLLMEngine:
    configure_torch(config.num_threads, config.seed)
    return AsyncLLMEngine(LLMEngine(config)).start()


def _replica_id() -> str:
    """Ray Serve's id of this replica; a fixed name outside Serve (tests building the class directly)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not in a Serve replica
        return "local"
