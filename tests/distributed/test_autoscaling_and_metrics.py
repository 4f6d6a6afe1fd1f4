"""The Ray app's autoscaling policy (on Ray Serve's own AutoscalingContext) and its per-replica metrics."""

from __future__ import annotations

from ray.serve.config import AutoscalingConfig, AutoscalingContext

from batchserve.distributed.autoscaling import engine_load_policy
from batchserve.distributed.metrics import ReplicaBoard, relabelled
from batchserve.serving.metrics import EngineMetrics, parse_metrics


def _context(replicas: int, engine_requests: list[float], kv_usage: list[float], handle_requests: float = 0.0):
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


def test_metrics_of_every_replica_are_served_labelled_by_replica():
    board = ReplicaBoard()
    for replica, tokens in (("a", 5), ("b", 7)):
        metrics = EngineMetrics("m")
        metrics.prompt_tokens.inc(tokens)
        board.post(replica, metrics.render().decode())
    text = relabelled(board.snapshot()).decode()
    assert 'batchserve:prompt_tokens_total{model_name="m",replica="a"} 5.0' in text
    assert 'batchserve:prompt_tokens_total{model_name="m",replica="b"} 7.0' in text
    assert parse_metrics(text)["batchserve:prompt_tokens_total"] == 12


def test_a_replica_that_stopped_posting_drops_off_the_board(monkeypatch):
    from batchserve.distributed import metrics

    clock = [0.0]
    monkeypatch.setattr(metrics.time, "monotonic", lambda: clock[0])
    board = ReplicaBoard()
    board.post("gone", "")
    clock[0] = metrics.STALE_AFTER_S + 1
    board.post("alive", "")
    assert set(board.snapshot()) == {"alive"}
