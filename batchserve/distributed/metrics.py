"""The Ray app's metrics. Each engine replica's Prometheus metrics ride on the load report Ray Serve already asks
it for every routing-stats period (EngineReplica.record_routing_stats), which Serve's controller hands to every
router; the ingress's /metrics serves what its routers last heard from each running replica, each series labelled
with its replica, beside the routers' decisions (ROUTER_METRICS, counted in the ingress's process where the router
runs). A replica Serve stopped (dead, or scaled down) leaves its routers' replica set, and /metrics with it.

No deployment of its own: a metrics actor of its own (the last design) was one more Ray worker process waking ~190
times a second (its event loop, its signal check every 10 ms, its gRPC threads), each wake-up taking a core from an
engine thread on a small machine.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

METRICS_KEY = "metrics"  # the routing stats' entry holding the replica's rendered metrics
REPORTED_AT_KEY = "reported_at"  # and when (time.time()) the replica rendered them
# Serve keeps handing out a replica's last stats when its record_routing_stats stops answering (a hung replica, until
# its health check fails): older ones are left out.
STALE_AFTER_S = 10.0

ROUTER_METRICS = CollectorRegistry()
ROUTER_DECISIONS = Counter(
    "batchserve:router_decisions",
    "Requests routed, by decision: prefix (longest cached prefix), no_match (the replica with the most cache room) "
    "or overloaded (power of two choices).",
    ["decision"],
    registry=ROUTER_METRICS,
)
REQUESTS_MOVED = Counter(
    "batchserve:requests_moved",
    "Requests handed to another replica because theirs was lost: kind retry (nothing streamed yet) or continue (from "
    "the tokens already streamed).",
    ["kind"],
    registry=ROUTER_METRICS,
)
ROUTER_MATCHED_BLOCKS = Counter(
    "batchserve:router_matched_blocks",
    "Prompt blocks the chosen replica was expected to hold.",
    registry=ROUTER_METRICS,
)

# The request routers in this process (router.py adds each as Ray Serve builds it, maybe on its router thread).
ROUTERS: weakref.WeakSet[Any] = weakref.WeakSet()
_ROUTERS_LOCK = threading.Lock()


def register_router(router: Any) -> None:
    with _ROUTERS_LOCK:
        ROUTERS.add(router)


def metrics_report(metrics_text: str) -> dict[str, Any]:
    """The routing stats' entries carrying a replica's rendered metrics."""
    return {METRICS_KEY: metrics_text, REPORTED_AT_KEY: time.time()}


def replica_metrics(routers: Iterable[Any] | None = None, now: float | None = None) -> dict[str, str]:
    """{replica id: its rendered metrics} for every running replica the routers know that reported them in the
    last STALE_AFTER_S; `routers`: objects with Ray Serve's RequestRouter.curr_replicas (default: ROUTERS)."""
    now = time.time() if now is None else now
    texts = {}
    for replica_id, stats in routers_replica_stats(routers).items():
        text, reported_at = stats.get(METRICS_KEY), stats.get(REPORTED_AT_KEY, 0.0)
        if isinstance(text, str) and now - reported_at <= STALE_AFTER_S:
            texts[replica_id] = text
    return texts


def routers_replica_stats(routers: Iterable[Any] | None = None) -> dict[str, dict[str, Any]]:
    """{replica id: the routing stats it last reported} for every running replica the routers know (default: the
    routers of this process)."""
    if routers is None:
        with _ROUTERS_LOCK:
            routers = list(ROUTERS)
    return {
        replica_id.unique_id: replica.routing_stats or {}
        for router in routers
        for replica_id, replica in dict(router.curr_replicas).items()
    }


def relabelled(texts: Mapping[str, str], label: str = "replica") -> bytes:
    """One exposition of several replicas' metrics, each sample labelled `label`=<replica id>."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for sample in family.samples:
                merged.samples.append(sample._replace(labels={**sample.labels, label: replica}))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Fixed(families.values()))
    return generate_latest(registry)


class _Fixed:
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterable[Metric]:
        return self.families
