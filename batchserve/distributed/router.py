"""PrefixAwareRouter: Ray Serve's RequestRouter API over the prefix- and load-aware policy of serving/routing.py.

Runs inside the caller of the deployment handle (the ingress). A request goes to the replica that was sent the
longest run of its prompt's leading blocks, unless that replica is busier than the least loaded one by more than
`max_imbalance` requests or its KV pool is over `max_kv_usage`; then power of two choices on queue length (two
random replicas, Ray Serve probes both and takes the shorter queue). A prompt no replica holds goes to the replica
remembering the fewest blocks among those not overloaded (serving/routing.py). A replica's load is the larger of what this
router has in flight there and what the replica last reported (record_routing_stats: running + waiting, KV usage).
A request naming a LoRA adapter, where no prefix decides, goes to a replica that reported the adapter loaded
(serving/routing.py). Decisions are counted in metrics.ROUTER_METRICS, which the ingress's /metrics serves.

A `subscribe` call (distributed/outbox.py) names the replica whose outputs it asks for: both routers here send it
there and nowhere else (PowerOfTwoRouter is Ray Serve's default router plus that rule), and it is not counted as
load.

Ray Serve pickles this module by value to ship the class: module-level state here would be copied, so the counters
live in distributed/metrics.py, referenced through its module.
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Any

from ray.serve._private.request_router import PowerOfTwoChoicesRequestRouter  # Serve's default: not public API
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

from batchserve.distributed import metrics
from batchserve.distributed.messages import ReplicaLoadReport, ReplicaRequest, Subscribe
from batchserve.serving.routing import Choice, Decision, PrefixRoutingPolicy, ReplicaLoad, RoutingConfig, block_hashes

MAX_PENDING_DECISIONS = 4096


class PinsSubscriptions:
    """Mixed into a RequestRouter: a subscribe call goes to the replica it names, any other to `choose_unpinned`;
    the router is listed in metrics.ROUTERS, where the ingress's /metrics finds the replicas' reports."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        metrics.register_router(self)

    async def choose_replicas(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None
    ) -> list[list[RunningReplica]]:
        subscription = _subscription(pending_request)
        if subscription is not None:
            return _pinned(candidate_replicas, subscription)
        return await self.choose_unpinned(candidate_replicas, pending_request)

    async def choose_unpinned(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        raise NotImplementedError


class PrefixAwareRouter(PinsSubscriptions, RequestRouter):
    def initialize_state(self, **kwargs: Any) -> None:
        """kwargs: RoutingConfig's fields (request_router_kwargs of the deployment's RequestRouterConfig)."""
        self.policy = PrefixRoutingPolicy(RoutingConfig(**kwargs))
        self._in_flight: defaultdict[ReplicaID, int] = defaultdict(int)
        self._routed: dict[str, tuple[list[int], Choice]] = {}  # internal request id -> its hashes and decision
        self._subscriptions: set[str] = set()  # internal request ids of subscribe calls

    async def choose_unpinned(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        if pending_request is not None:
            pending_request.routing_context.should_backoff = True  # after these ranks, back off before retrying
        request = _replica_request(pending_request)
        adapter = request.lora_name if request is not None else None
        hashes = self._hashes(request, adapter)
        by_id = {r.replica_id: r for r in candidate_replicas}
        choice = self.policy.choose(hashes, {rid: self._load(r) for rid, r in by_id.items()}, adapter)
        if pending_request is not None:
            self._routed[pending_request.metadata.internal_request_id] = (hashes, choice)
            while len(self._routed) > MAX_PENDING_DECISIONS:  # requests cancelled before they were routed
                self._routed.pop(next(iter(self._routed)))
        if choice.replica is None:
            return [_two_random(candidate_replicas)]
        others = [r for rid, r in by_id.items() if rid != choice.replica]
        return [[by_id[choice.replica]], _two_random(others)] if others else [[by_id[choice.replica]]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        if _subscription(pending_request) is not None:
            self._subscriptions.add(pending_request.metadata.internal_request_id)
            return
        self._in_flight[replica_id] += 1
        hashes, choice = self._routed.pop(pending_request.metadata.internal_request_id, ([], None))
        if choice is None:
            return
        went_as_chosen = choice.replica is None or choice.replica == replica_id
        chosen = choice.decision in (Decision.PREFIX, Decision.ADAPTER)
        decision = Decision.OVERLOADED if chosen and not went_as_chosen else choice.decision
        metrics.ROUTER_DECISIONS.labels(decision).inc()
        if decision == Decision.PREFIX:
            metrics.ROUTER_MATCHED_BLOCKS.inc(choice.matched_blocks)
        self.policy.routed(replica_id, hashes)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        if internal_request_id in self._subscriptions:
            self._subscriptions.discard(internal_request_id)
            return
        if self._in_flight.get(replica_id, 0) > 0:
            self._in_flight[replica_id] -= 1
        self._routed.pop(internal_request_id, None)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.policy.index.forget(replica_id)  # its replacement starts with an empty cache
        self._in_flight.pop(replica_id, None)

    def _load(self, replica: RunningReplica) -> ReplicaLoad:
        report = ReplicaLoadReport.from_dict(replica.routing_stats) or ReplicaLoadReport()
        queue_len = max(self._in_flight.get(replica.replica_id, 0), report.queue_len)
        return ReplicaLoad(queue_len=queue_len, kv_usage=report.kv_usage, adapters=frozenset(report.loras))

    def _hashes(self, request: ReplicaRequest | None, adapter: str | None) -> list[int]:
        if request is None or not request.prompt_token_ids:
            return []
        return block_hashes(request.prompt_token_ids, self.policy.config.block_size, adapter)


class PowerOfTwoRouter(PinsSubscriptions, PowerOfTwoChoicesRequestRouter):
    """Ray Serve's default router (power of two choices on queue length), with subscriptions pinned."""

    async def choose_unpinned(
        self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None
    ) -> list[list[RunningReplica]]:
        return await PowerOfTwoChoicesRequestRouter.choose_replicas(self, candidate_replicas, pending_request)


def _replica_request(pending_request: PendingRequest | None) -> ReplicaRequest | None:
    if pending_request is None:
        return None
    args = (*pending_request.args, *pending_request.kwargs.values())
    return next((a for a in args if isinstance(a, ReplicaRequest)), None)


def _subscription(pending_request: PendingRequest | None) -> Subscribe | None:
    if pending_request is None:
        return None
    return next(
        (a for a in (*pending_request.args, *pending_request.kwargs.values()) if isinstance(a, Subscribe)), None
    )


def _pinned(candidates: list[RunningReplica], subscription: Subscribe) -> list[list[RunningReplica]]:
    """The named replica, or no choice while it is not among the candidates (being replaced: the caller's requests
    there fail, and it cancels the call)."""
    chosen = [r for r in candidates if r.replica_id.unique_id == subscription.replica_id]
    return [chosen] if chosen else []


def _two_random(replicas: list[RunningReplica]) -> list[RunningReplica]:
    return random.sample(replicas, min(2, len(replicas)))
