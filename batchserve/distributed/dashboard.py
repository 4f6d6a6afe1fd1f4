"""The live dashboard of the Ray app: each engine replica keeps its own LiveStats and sends a snapshot of it with
the load report Ray Serve already asks it for every routing-stats period (the metrics ride the same way:
distributed/metrics.py), so the ingress's /dashboard/data answers from what its routers last heard, one replica at a
time (`?replica=<id>`, default the first): one replica's steps are one iteration timeline, several replicas' are not.

The page is as fresh as the routing-stats period (seconds), not once a second as beside a local engine.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from batchserve.distributed.metrics import REPORTED_AT_KEY, STALE_AFTER_S, routers_replica_stats
from batchserve.serving.live_stats import LiveStats

DASHBOARD_KEY = "dashboard"  # the routing stats' entry holding the replica's LiveStats snapshot
STEPS_SENT = 300  # steps per report: what the page draws
REQUESTS_SENT_S = 2 * STALE_AFTER_S  # finished requests per report: those of the last seconds (doctor polls often)


def dashboard_report(live_stats: LiveStats) -> dict[str, Any]:
    """The routing stats' entry carrying a replica's dashboard snapshot (its last STEPS_SENT steps, and the requests
    finished in the last REQUESTS_SENT_S)."""
    snapshot = live_stats.snapshot(with_requests=True, finished_after=time.time() - REQUESTS_SENT_S)
    snapshot["steps"] = snapshot["steps"][-STEPS_SENT:]
    return {DASHBOARD_KEY: snapshot}


class ReplicaDashboards:
    """LiveStats.snapshot's interface over the replicas' reports, for the dashboard routes of the ingress."""

    def __init__(self, routers: Iterable[Any] | None = None) -> None:
        self.routers = routers  # None: the routers of this process (metrics.ROUTERS)

    def snapshot(
        self, since_step: int = -1, with_requests: bool = False, finished_after: float = 0.0, replica: str = ""
    ) -> dict[str, Any]:
        reports = {
            rid: stats[DASHBOARD_KEY]
            for rid, stats in routers_replica_stats(self.routers).items()
            if DASHBOARD_KEY in stats and time.time() - stats.get(REPORTED_AT_KEY, 0.0) <= STALE_AFTER_S
        }
        replicas = sorted(reports)
        if replica and replica not in reports:  # another replica's data would pass for this one's
            raise LookupError(f"no replica {replica!r} is reporting; replicas: {', '.join(replicas) or 'none yet'}")
        chosen = replica or (replicas[0] if replicas else "")
        snapshot = dict(reports.get(chosen) or LiveStats().snapshot())
        index = snapshot["step_fields"].index("index")
        snapshot["steps"] = [s for s in snapshot["steps"] if s[index] > since_step]
        if with_requests:
            snapshot["requests"] = [r for r in snapshot.get("requests", []) if r["finished_time"] > finished_after]
        else:
            snapshot.pop("requests", None)
        return {**snapshot, "replica": chosen, "replicas": replicas}
