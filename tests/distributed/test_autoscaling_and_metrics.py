"""The Ray app's autoscaling policy (on Ray Serve's own AutoscalingContext) and its per-replica metrics."""

from __future__ import annotations

from batchserve.distributed.autoscaling import engine_load_policy
from batchserve.distributed.metrics import STALE_AFTER_S, metrics_report, relabelled, replica_metrics
from batchserve.serving.metrics import EngineMetrics, parse_metrics

# Ray Serve's classes are imported by the tests that build them: every test worker collects this file, and Ray
# Serve's import is most of a second of CPU that a worker which never runs it would pay.


def _context(replicas: int, engine_requests: list[float], kv_usage: list[float], handle_requests: float = 0.0):
    from ray.serve.config import AutoscalingConfig, AutoscalingContext

    ids = [f"r{i}" for i in range(replicas)]
    metrics = {"engine_requests": dict(zip(ids, engine_requests)), "kv_usage": dict(zip(ids, kv_usage))}
    return AutoscalingContext(
        deployment_id=None, deployment_name="EngineReplica", app_name="batchserve",
        current_num_replicas=replicas, target_num_replicas=replicas, running_replicas=ids,
        total_num_requests=handle_requests, total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics=None,
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=8, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=None,
        config=AutoscalingConfig(min_replicas=1, max_replicas=8, target_ongoing_requests=16),
    )  # fmt: skip


def test_replicas_follow_engine_load_not_handle_requests():
    # the handles see 4 requests in flight; the engines hold 64 (running + waiting): 64 / 16 per replica = 4
    desired, _ = engine_load_policy(_context(2, [40, 24], [0.3, 0.2], handle_requests=4))
    assert desired == 4
    desired, _ = engine_load_policy(_context(2, [2, 2], [0.1, 0.1], handle_requests=30))
    assert desired == 0.25  # Ray Serve rounds and bounds it by min_replicas


def test_a_full_kv_pool_asks_for_one_more_replica():
    desired, _ = engine_load_policy(_context(2, [8, 8], [0.97, 0.93]))
    assert desired == 3


def test_replicas_not_reported_yet_count_with_the_handles_view():
    context = _context(2, [], [], handle_requests=48)
    assert engine_load_policy(context)[0] == 3


class _Replica:  # what a router's curr_replicas holds: Ray Serve's RunningReplica, by its ReplicaID
    def __init__(self, routing_stats):
        self.routing_stats = routing_stats


class _Router:
    def __init__(self, replicas):
        from ray.serve._private.common import DeploymentID, ReplicaID

        self.curr_replicas = {ReplicaID(unique_id=r, deployment_id=DeploymentID("E")): s for r, s in replicas.items()}


def _report(tokens: int) -> _Replica:
    metrics = EngineMetrics("m")
    metrics.prompt_tokens.inc(tokens)
    return _Replica({"num_running": 1, "num_waiting": 0, "kv_usage": 0.1, **metrics_report(metrics.render().decode())})


def test_metrics_of_every_replica_are_served_labelled_by_replica():
    text = relabelled(replica_metrics([_Router({"a": _report(5), "b": _report(7)})])).decode()
    assert 'batchserve:prompt_tokens_total{model_name="m",replica="a"} 5.0' in text
    assert 'batchserve:prompt_tokens_total{model_name="m",replica="b"} 7.0' in text
    assert parse_metrics(text)["batchserve:prompt_tokens_total"] == 12


def test_only_replicas_that_reported_metrics_are_listed_once_across_routers():
    fresh = _Replica({})  # running, its first routing stats not in yet
    routers = [_Router({"a": _report(5), "new": fresh}), _Router({"a": _report(5)})]
    assert set(replica_metrics(routers)) == {"a"}
    assert replica_metrics([]) == {}


def test_a_replica_whose_last_report_is_old_is_left_out():
    """Serve hands out a replica's last routing stats while its record_routing_stats hangs."""
    router = _Router({"hung": _report(3), "alive": _report(4)})
    reported_at = router.curr_replicas[next(iter(router.curr_replicas))].routing_stats["reported_at"]
    assert set(replica_metrics([router], now=reported_at + STALE_AFTER_S - 1)) == {"hung", "alive"}
    router.curr_replicas[next(iter(router.curr_replicas))].routing_stats["reported_at"] -= 2 * STALE_AFTER_S
    assert set(replica_metrics([router], now=reported_at + STALE_AFTER_S - 1)) == {"alive"}
