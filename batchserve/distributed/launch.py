"""`batchserve serve --replicas N`: the Ray Serve application on the Ray instance already running on this machine,
or a local one started for it (or, with --ray-address, a cluster's), until SIGINT/SIGTERM (then requests in flight
get --drain-timeout seconds to finish). The ingress serves HTTP on --host/--port itself, with Ray Serve's proxy off
(one process and one Ray message per response chunk fewer); --ray-proxy puts Ray's proxy there instead, as
`serve run` does.

Every `batchserve serve` flag keeps its meaning. Engine threads: unless --num-threads is given, each replica gets
the machine's cores divided by the replicas (2 replicas on 2 cores: 1 thread each), so replicas do not fight over
cores.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import signal
import sys
import threading
from collections.abc import Callable
from types import FrameType
from typing import Any

from batchserve import env
from batchserve.config import ConfigError
from batchserve.distributed.options import RayAppOptions
from batchserve.entrypoints.engine_args import engine_options_from_args
from batchserve.entrypoints.engine_options import engine_config
from batchserve.entrypoints.openai.launch import make_parser

logger = logging.getLogger("batchserve.distributed")

APP_NAME = "batchserve"

# Ray's periodic work that this application does not use, slowed down or off in a Ray instance that `serve
# --replicas` starts itself (the processes it spawns inherit the environment). On a small machine every wake-up of
# Ray's threads preempts an engine thread, so fewer wake-ups raise a replica's throughput through Ray; Ray Serve's
# throughput-optimized mode (deployment handles over gRPC, user code and the router on the replica's own event loop)
# raises it and cuts TTFT further (docs/scale-out.md has the alternated runs). Its direct ingress (Serve's own HTTP
# server in the ingress replica) stays off, the ingress serves HTTP itself. A value the user exported wins.
LOCAL_RAY_ENVIRONMENT = {
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",
    "RAY_SERVE_ENABLE_DIRECT_INGRESS": "0",
    "RAY_SERVE_CONTROL_LOOP_INTERVAL_S": "0.5",  # the controller reconciles twice a second, not ten times
    "RAY_SERVE_METRICS_EXPORT_INTERVAL_MS": "2000",  # Serve's own request metrics; the app serves its own
    "RAY_enable_metrics_collection": "0",  # Ray's Prometheus metrics
    "RAY_event_stats": "0",  # per-handler timing of Ray's event loops
    "RAY_task_events_report_interval_ms": "0",  # the dashboard's task timeline (the dashboard is off)
}


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    parser.prog = "batchserve serve --replicas N"
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    replicas = args.replicas or 1
    try:
        engine = engine_options_from_args(args, **({"model": args.model} if args.model else {}))
        engine.setdefault("num_threads", max(1, (os.cpu_count() or 1) // replicas))
        engine_config(engine, "the command line")
        options = RayAppOptions(
            engine=engine, replicas=replicas, max_replicas=args.max_replicas,
            target_ongoing_requests=args.target_ongoing_requests, router=args.router,
            replica_num_cpus=args.replica_cpus,
            served_model_name=[n.strip() for n in (args.served_model_name or "").split(",") if n.strip()],
            api_key=args.api_key or env.api_key(), max_body_bytes=args.max_body_bytes, lenient=args.lenient,
            stall_timeout_s=args.stall_timeout, grpc_port=args.grpc_port, grpc_host=args.host,
            drain_timeout_s=args.drain_timeout, header_timeout_s=args.header_timeout,
            body_timeout_s=args.body_timeout, keep_alive_timeout_s=args.keep_alive_timeout,
            max_connections=args.max_connections, error_delay_max_s=args.error_delay_max,
            error_delay_after=args.error_delay_after, error_delay_clients=args.error_delay_clients,
        )  # fmt: skip
    except (ConfigError, ValueError) as exc:
        parser.error(str(exc))
    return run(options, args.host, args.port, args.ray_address, args.ray_proxy)


def run(options: RayAppOptions, host: str, port: int, ray_address: str | None, ray_proxy: bool = False) -> int:
    """`ray_proxy`: HTTP through Ray Serve's proxy (one more process and Ray hop per response chunk) instead of the
    ingress's own server."""
    import ray

    joined = _connect(options, ray_address)
    # Ray Serve reads its settings when first imported, in this process too (the handles the application is built
    # with take their transport from here): after _connect has exported LOCAL_RAY_ENVIRONMENT
    from ray import serve

    from batchserve.distributed.app import build_application

    stop = threading.Event()
    previous = {sig: signal.signal(sig, _setter(stop)) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if ray_proxy:
            serve.start(http_options={"host": host, "port": port})
        else:  # the ingress serves HTTP itself
            serve.start(proxy_location="Disabled")
            options = options.model_copy(update={"http_host": host, "http_port": port})
        # no route prefix when the ingress serves HTTP: Serve would log its disabled proxy's address as the app's
        ingress = serve.run(build_application(options), name=APP_NAME, route_prefix="/" if ray_proxy else None)
        calls = _HandleCalls()
        logger.info("replicas run: %s", calls.call(ingress, "engine_config", timeout_s=60))
        logger.info("serving on http://%s:%d (Ray Serve, %s)", host, port, _describe(options, ray_proxy))
        stop.wait()
        logger.info("stopping: requests in flight get %.0f s to finish", options.drain_timeout_s)
        try:
            calls.call(ingress, "drain", timeout_s=options.drain_timeout_s + 15)
        except Exception as exc:  # stopping regardless: say why the requests in flight may have been cut
            logger.warning("draining the ingress failed: %r", exc)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if joined:  # a cluster that was there before us: take our application away, leave the rest running
            serve.delete(APP_NAME)
        # a Ray instance of our own goes down whole, Serve's controller with it: serve.shutdown() would have the
        # controller kill itself inside its graceful_shutdown call, which Ray reports as a failed task on exit
        ray.shutdown()
    return 0


class _HandleCalls:
    """Calls on Serve deployment handles from this (synchronous) launcher. Serve's throughput-optimized mode runs a
    handle's router on the caller's event loop, so the calls run on one loop of their own in a daemon thread (one
    loop for all of them: the handle's router stays bound to the loop of its first call)."""

    def __init__(self) -> None:
        self._loop = asyncio.new_event_loop()
        threading.Thread(target=self._loop.run_forever, name="serve-handle-calls", daemon=True).start()

    def call(self, handle: Any, method: str, timeout_s: float) -> Any:
        async def remote() -> Any:  # even looking the method up binds the handle to the running loop
            return await getattr(handle, method).remote()

        return asyncio.run_coroutine_threadsafe(remote(), self._loop).result(timeout=timeout_s)


def _connect(options: RayAppOptions, ray_address: str | None) -> bool:
    """Join `ray_address`, else a Ray instance already running on this machine (or at $RAY_ADDRESS), else start a
    local one sized for the replicas. True when it joined an existing instance."""
    import ray

    if ray_address:
        ray.init(address=ray_address)
        return True
    try:
        ray.init(address="auto")
        logger.info("joined the Ray instance running on this machine")
        return True
    except ConnectionError:
        cpus = max(os.cpu_count() or 1, math.ceil(options.replicas * options.replica_num_cpus))
        for name, value in LOCAL_RAY_ENVIRONMENT.items():
            os.environ.setdefault(name, value)
        ray.init(num_cpus=cpus, include_dashboard=False)
        return False


def _describe(o: RayAppOptions, ray_proxy: bool) -> str:
    scaling = f"{o.replicas}-{o.max_replicas} replicas, autoscaled" if o.autoscaling else f"{o.replicas} replicas"
    http = "HTTP through Ray Serve's proxy" if ray_proxy else "HTTP served by the ingress"
    return f"{scaling}, router {o.router}, {http}"


def _setter(stop: threading.Event) -> Callable[[int, FrameType | None], None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    return handler
