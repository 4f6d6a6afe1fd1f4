"""The Ray Serve application: OpenAIIngress -> EngineReplica x N (routed by PrefixAwareRouter or Ray Serve's
power of two choices).

    serve run batchserve.distributed.app:build replicas=2 router=prefix-aware
    serve run examples/ray_serve.yaml        # the same, from a Serve config file (import_path + args)
    batchserve serve --replicas 2            # starts a local Ray instance and runs this (launch.py)
"""

from __future__ import annotations

from typing import Any

from ray import serve
from ray.serve.config import AutoscalingConfig, AutoscalingPolicy, RequestRouterConfig

from batchserve.distributed.autoscaling import engine_load_policy
from batchserve.distributed.ingress import OpenAIIngress
from batchserve.distributed.options import RayAppOptions
from batchserve.distributed.replica import EngineReplica
from batchserve.distributed.router import PowerOfTwoRouter, PrefixAwareRouter
from batchserve.entrypoints.engine_options import engine_config

# How often Serve's controller asks each replica for its load and metrics and hands them to the routers: each round
# wakes the replica, the controller and the ingress. The routers count their own requests in flight, so queue lengths
# stay current between reports, and a slower round leaves the engine threads more CPU (docs/scale-out.md has the
# alternated runs).
ROUTING_STATS_PERIOD_S = 2.0


def build_application(options: RayAppOptions) -> serve.Application:
    config = engine_config(options.engine, "the Ray Serve app")  # checked here, before any replica starts
    quiet = {"enable_access_log": False}  # no log line per engine call; the ingress logs requests
    engines = serve.deployment(
        EngineReplica,
        name="EngineReplica",
        ray_actor_options={"num_cpus": options.replica_num_cpus},
        max_ongoing_requests=options.max_ongoing_requests,
        health_check_period_s=options.health_check_period_s,
        health_check_timeout_s=max(30.0, options.health_check_period_s),
        graceful_shutdown_timeout_s=options.drain_timeout_s,  # scaled down or redeployed: requests finish first
        logging_config=quiet,
        request_router_config=_router_config(options, config.cache.block_size, config.cache.num_kv_blocks),
        **_replica_count(options),
    ).bind(options.engine, _model_name(options, config.model), options.stall_timeout_s)
    ingress = serve.deployment(
        serve.ingress()(OpenAIIngress), name="OpenAIIngress", ray_actor_options={"num_cpus": 0},
        max_ongoing_requests=100_000,  # the engines queue; the ingress only relays
    )  # fmt: skip
    return ingress.bind(engines, options)


def build(args: dict[str, Any]) -> serve.Application:
    """Ray Serve's application builder: `serve run batchserve.distributed.app:build key=value ...` or a config
    file's `args:`. Keys are RayAppOptions' fields; engine options go under `engine` (a dict in a config file)."""
    return build_application(RayAppOptions.model_validate(args))


def _model_name(options: RayAppOptions, model: str | None) -> str:
    from batchserve.entrypoints.openai.app import model_names

    return model_names(options.served_model_name, model)[0]


def _router_config(options: RayAppOptions, block_size: int, num_kv_blocks: int | None) -> RequestRouterConfig:
    if options.router == "power-of-two":
        return RequestRouterConfig(
            request_router_class=f"{PowerOfTwoRouter.__module__}.{PowerOfTwoRouter.__name__}",
            request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
        )
    routing = {"block_size": block_size, **({"capacity_blocks": num_kv_blocks} if num_kv_blocks else {})}
    return RequestRouterConfig(
        request_router_class=f"{PrefixAwareRouter.__module__}.{PrefixAwareRouter.__name__}",  # imported there
        request_router_kwargs={**routing, **options.routing},
        request_routing_stats_period_s=ROUTING_STATS_PERIOD_S,
    )


def _replica_count(options: RayAppOptions) -> dict[str, Any]:
    if not options.autoscaling:
        return {"num_replicas": options.replicas}
    return {
        "autoscaling_config": AutoscalingConfig(
            min_replicas=options.replicas,
            max_replicas=options.max_replicas,
            target_ongoing_requests=options.target_ongoing_requests,
            policy=AutoscalingPolicy(policy_function=f"{engine_load_policy.__module__}:{engine_load_policy.__name__}"),
        )
    }
