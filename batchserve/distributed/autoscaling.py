"""A Ray Serve autoscaling policy on engine load: the replicas' own count of running + waiting requests
(record_autoscaling_stats), not only the requests in flight through handles, and their KV pools' usage.

Desired replicas = total engine requests / target_ongoing_requests, as Ray Serve's default policy computes from
handle requests; a deployment whose replicas' KV pools average over KV_PRESSURE is given one replica more even
when the request count alone would not ask for it (long contexts fill the pool before the slots). Ray Serve then
applies min/max replicas, the up/down-scaling delays and factors of the AutoscalingConfig.
"""

from __future__ import annotations

from typing import Any

KV_PRESSURE = 0.9


def engine_load_policy(ctx: Any) -> tuple[float, dict[str, Any]]:
    """`ctx`: ray.serve.config.AutoscalingContext."""
    replicas = ctx.current_num_replicas
    if replicas == 0:
        return ctx.target_num_replicas, {}
    metrics = ctx.aggregated_metrics or {}
    reported = metrics.get("engine_requests") or {}
    # replicas that have not reported yet (just started) count with the handles' view of them
    total = sum(reported.values()) if reported else ctx.total_num_requests
    desired = total / ctx.config.get_target_ongoing_requests()
    kv = list((metrics.get("kv_usage") or {}).values())
    if kv and sum(kv) / len(kv) > KV_PRESSURE:
        desired = max(desired, replicas + 1)
    return desired, {}
