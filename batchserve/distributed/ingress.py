"""OpenAIIngress: the Ray Serve ingress deployment. Ray Serve's HTTP proxy hands it each request; it answers with
the same OpenAI (and KServe) routes as `batchserve serve`, over RemoteEngineClient, so tokenizing, validation,
streaming and errors are the serving layer's. /metrics: every running replica's metrics, labelled `replica`, and
the router's decisions (distributed/metrics.py) and the offender table's counts; /health: 503 while no running
replica has reported. Repeat offenders' 4xx answers wait as on `batchserve serve` (one table for every port here).

With `grpc_port`, the ingress also runs batchserve's gRPC server (batchserve.v1.Generation, KServe v2, health,
reflection) on that port, over the same client: one ingress replica binds it (Ray Serve's own gRPC proxy would need
the services re-declared as deployment methods). With `http_port`, it serves the same HTTP routes on that port
itself (uvicorn on its event loop), so a client's bytes skip Ray's HTTP proxy and the Ray message per response chunk
from the ingress to the proxy: `batchserve serve --replicas N` runs it so, with Ray's proxy off."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry, generate_latest

from batchserve.distributed.client import RemoteEngineClient
from batchserve.distributed.dashboard import ReplicaDashboards
from batchserve.distributed.metrics import ROUTER_METRICS, relabelled, replica_metrics
from batchserve.distributed.options import RayAppOptions
from batchserve.entrypoints.grpc.server import GrpcServer
from batchserve.entrypoints.openai.app import build_front_app, model_names
from batchserve.entrypoints.openai.connections import ConnectionLimits
from batchserve.entrypoints.openai.dashboard import add_dashboard_routes
from batchserve.entrypoints.openai.error_delay import ErrorDelayCollector

HTTP_START_TIMEOUT_S = 30.0


class OpenAIIngress:
    async def __init__(self, engines: Any, options: RayAppOptions) -> None:
        """`engines`: a handle of the EngineReplica deployment."""
        self.client = await RemoteEngineClient.connect(engines)
        self.options = options
        self.names = model_names(options.served_model_name, self.client.config.model)
        # one table for every front end here (Ray's proxy, the ingress's own HTTP port, gRPC): an offender is one
        # client whichever port it uses
        self.offenders = options.offender_table()
        self._offender_metrics = CollectorRegistry(auto_describe=False)
        self._offender_metrics.register(ErrorDelayCollector(self.offenders, self.names[0]))
        self.grpc_server: GrpcServer | None = None
        if options.grpc_port is not None:
            self.grpc_server = GrpcServer(
                self.client, self.names, host=options.grpc_host, port=options.grpc_port, api_key=options.api_key,
                max_request_bytes=options.max_body_bytes, health_problem=self.health_problem,
                offenders=self.offenders,
            )  # fmt: skip
            await self.grpc_server.start()
        self.http_server: uvicorn.Server | None = None
        if options.http_port is not None:
            await self._start_http(options.http_host, options.http_port)

    def __serve_build_asgi_app__(self) -> FastAPI:
        return self._front_app()

    def _front_app(self) -> FastAPI:
        options = self.options
        app = build_front_app(
            self.client,
            self.names,
            api_key=options.api_key,
            max_body_bytes=options.max_body_bytes,
            lenient=options.lenient,
            render_metrics=self.render_metrics,
            health_problem=self.health_problem,
            offenders=self.offenders,
        )
        add_dashboard_routes(app, ReplicaDashboards())
        return app

    async def _start_http(self, host: str, port: int) -> None:
        """Bound here first, so a port in use fails the replica's start with the OSError (uvicorn would exit the
        process instead)."""
        listener = socket.create_server((host, port), reuse_port=False)
        options = self.options
        limits = ConnectionLimits(
            options.header_timeout_s, options.body_timeout_s, options.keep_alive_timeout_s, options.max_connections,
            max_body_bytes=options.max_body_bytes,
        )  # fmt: skip
        config = uvicorn.Config(
            self._front_app(),
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=options.drain_timeout_s,
            **limits.uvicorn_options(self.offenders),
        )
        self.http_server = uvicorn.Server(config)
        self._http_task = asyncio.ensure_future(self.http_server.serve(sockets=[listener]))
        deadline = asyncio.get_running_loop().time() + HTTP_START_TIMEOUT_S
        while not self.http_server.started:
            if self._http_task.done():
                self._http_task.result()  # raises why it stopped
                raise RuntimeError(f"the ingress's HTTP server on {host}:{port} stopped while starting")
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError(f"the ingress's HTTP server on {host}:{port} did not start")
            await asyncio.sleep(0.05)

    async def drain(self) -> None:
        """Stop taking requests on the ingress's own ports; those in flight get the drain timeout to finish. The
        launcher calls it before it stops the application (Ray Serve's graceful shutdown counts only the requests
        that came through its proxy)."""
        grace = self.options.drain_timeout_s
        if self.http_server is not None:
            self.http_server.should_exit = True
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._http_task), grace + 5)
        if self.grpc_server is not None:
            await self.grpc_server.stop(grace)

    def __del__(self) -> None:
        if getattr(self, "http_server", None) is not None:
            self.http_server.should_exit = True

    async def render_metrics(self) -> bytes:
        return relabelled(replica_metrics()) + generate_latest(ROUTER_METRICS) + generate_latest(self._offender_metrics)

    def engine_config(self) -> dict[str, str]:
        """The replicas' options as they run them (they all run the same): Ray Serve keeps replicas' own logs out
        of the launcher's console, so the launcher logs this."""
        return self.client.description.effective_config

    async def health_problem(self) -> str | None:
        if not replica_metrics():
            return "no running engine replica has reported yet"
        return None
