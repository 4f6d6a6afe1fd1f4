"""OpenAIIngress: the Ray Serve ingress deployment. Ray Serve's HTTP proxy hands it each request; it answers with
the same OpenAI (and KServe) routes as `batchserve serve`, over RemoteEngineClient, so tokenizing, validation,
streaming and errors are the serving layer's. /metrics: every replica's metrics, labelled `replica`, and the
router's decisions; /health: 503 while no replica has posted metrics recently (none alive).

With `grpc_port`, the ingress also runs batchserve's gRPC server (batchserve.v1.Generation, KServe v2, health,
reflection) on that port, over the same client: one ingress replica binds it (Ray Serve's own gRPC proxy would need
the services re-declared as deployment methods)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI
from prometheus_client import generate_latest

from batchserve.distributed.client import RemoteEngineClient
from batchserve.distributed.metrics import ROUTER_METRICS, relabelled
from batchserve.distributed.options import RayAppOptions
from batchserve.entrypoints.grpc.server import GrpcServer
from batchserve.entrypoints.openai.app import build_front_app, model_names

BOARD_TIMEOUT_S = 5.0


class OpenAIIngress:
    async def __init__(self, engines: Any, board: Any, options: RayAppOptions) -> None:
        """`engines`, `board`: handles of the EngineReplica and ReplicaBoard deployments."""
        self.client = await RemoteEngineClient.connect(engines)
        self.board = board
        self.options = options
        self.names = model_names(options.served_model_name, self.client.config.model)
        self.grpc_server: GrpcServer | None = None
        if options.grpc_port is not None:
            self.grpc_server = GrpcServer(
                self.client, self.names, host=options.grpc_host, port=options.grpc_port, api_key=options.api_key,
                max_request_bytes=options.max_body_bytes, health_problem=self.health_problem,
            )  # fmt: skip
            await self.grpc_server.start()

    def __serve_build_asgi_app__(self) -> FastAPI:
        options = self.options
        return build_front_app(
            self.client,
            self.names,
            api_key=options.api_key,
            max_body_bytes=options.max_body_bytes,
            lenient=options.lenient,
            render_metrics=self.render_metrics,
            health_problem=self.health_problem,
        )

    async def render_metrics(self) -> bytes:
        posts = await self._board_snapshot()
        return relabelled(posts or {}) + generate_latest(ROUTER_METRICS)

    async def health_problem(self) -> str | None:
        posts = await self._board_snapshot()
        if posts is None:
            return "the replicas' metrics board does not answer"
        if not posts:
            return "no engine replica has reported in the last seconds"
        return None

    async def _board_snapshot(self) -> dict[str, str] | None:
        """The board's snapshot, or None when it does not answer in time (being restarted by Serve)."""
        try:
            return await asyncio.wait_for(self.board.snapshot.remote(), BOARD_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - a timeout or a dead board: the caller reports it
            return None
