"""The Ray app's metrics. ReplicaBoard: a one-replica Ray Serve deployment where each engine replica posts its
Prometheus metrics; the ingress's /metrics serves them all, each series labelled with its replica, beside the
router's decisions (ROUTER_METRICS, counted in the ingress's process where the router runs).

A replica that stopped posting (dead, or scaled down) drops off the board after `STALE_AFTER_S`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

STALE_AFTER_S = 10.0

ROUTER_METRICS = CollectorRegistry()
ROUTER_DECISIONS = Counter(
    "batchserve:router_decisions",
    "Requests routed, by decision: prefix (longest cached prefix), no_match (the replica with the most cache room) "
    "or overloaded (power of two choices).",
    ["decision"],
    registry=ROUTER_METRICS,
)
ROUTER_MATCHED_BLOCKS = Counter(
    "batchserve:router_matched_blocks",
    "Prompt blocks the chosen replica was expected to hold.",
    registry=ROUTER_METRICS,
)


class ReplicaBoard:
    def __init__(self) -> None:
        self._posts: dict[str, tuple[float, str]] = {}

    def post(self, replica_id: str, metrics_text: str) -> None:
        self._posts[replica_id] = (time.monotonic(), metrics_text)

    def snapshot(self) -> dict[str, str]:
        """The latest metrics of each replica heard from within STALE_AFTER_S."""
        now = time.monotonic()
        self._posts = {r: (t, text) for r, (t, text) in self._posts.items() if now - t <= STALE_AFTER_S}
        return {r: text for r, (_, text) in self._posts.items()}


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
