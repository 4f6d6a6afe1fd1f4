"""The gRPC front end: grpcio's asyncio server with batchserve.v1.Generation, KServe v2's GRPCInferenceService,
grpc.health.v1 (SERVING while the engine loop runs and makes progress) and server reflection (so grpcurl-style
tools list and describe the services). It runs on whatever event loop starts it: `batchserve serve --grpc-port`
starts it on uvicorn's, so HTTP and gRPC share one process and one engine."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection, reflection_pb2

from batchserve.engine.async_engine import AsyncLLMEngine
from batchserve.engine.core_client import EngineCoreClient
from batchserve.entrypoints.grpc.auth import ApiKeyInterceptor
from batchserve.entrypoints.grpc.decoding import DecodeErrorInterceptor
from batchserve.entrypoints.grpc.error_delay import ErrorDelayInterceptor
from batchserve.entrypoints.grpc.generation import GenerationServicer
from batchserve.entrypoints.grpc.pb import generation_pb2, generation_pb2_grpc
from batchserve.entrypoints.grpc.served import DEFAULT_MAX_REQUEST_BYTES, ServedModel
from batchserve.entrypoints.kserve.model import KServeModel
from batchserve.entrypoints.kserve.pb import kserve_pb2, kserve_pb2_grpc
from batchserve.entrypoints.kserve.service import InferenceServicer
from batchserve.entrypoints.openai.error_delay import OffenderTable
from batchserve.serving.client import EngineClient
from batchserve.serving.generation import GenerationService

logger = logging.getLogger("batchserve.grpc")

GENERATION_SERVICE = generation_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
KSERVE_SERVICE = kserve_pb2.DESCRIPTOR.services_by_name["GRPCInferenceService"].full_name
HEALTH_CHECK_INTERVAL_S = 1.0
DEFAULT_STALL_TIMEOUT_S = 120.0  # as the HTTP server's /health


class GrpcServer:
    """Both gRPC services over one EngineClient: an AsyncLLMEngine in this process (shared: the caller starts and
    stops it; health follows its loop) or the Ray Serve app's RemoteEngineClient (health: `health_problem`)."""

    def __init__(
        self,
        engine: EngineClient,
        served_model_names: Sequence[str],
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        health_problem: Callable[[], Awaitable[str | None]] | None = None,
        offenders: OffenderTable | None = None,
    ) -> None:
        """`health_problem`: None while serving, else why not (default: a local engine's loop dead or stalled).
        `offenders`: the HTTP server's table; repeat offenders' refusals wait here too (error_delay.py)."""
        self.engine = engine
        self.health_problem = health_problem or self._local_engine_problem
        self.served = ServedModel(tuple(served_model_names), max_request_bytes)
        self.address = f"{host}:{port}"
        self.api_key = api_key
        self.stall_timeout_s = stall_timeout_s
        self.offenders = offenders if offenders is not None and offenders.config.enabled else None
        self.port: int | None = None  # bound by start()
        self._server: grpc.aio.Server | None = None
        self._health = health_aio.HealthServicer()
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> int:
        """Bind and serve; returns the port (the OS picks one for port 0). OSError when the port is taken."""
        if isinstance(self.engine, AsyncLLMEngine | EngineCoreClient):
            self.engine.start()
        service = GenerationService(self.engine)
        server = grpc.aio.server(
            interceptors=[
                *([ErrorDelayInterceptor(self.offenders)] if self.offenders is not None else []),
                *([ApiKeyInterceptor(self.api_key)] if self.api_key else []),
                DecodeErrorInterceptor((GENERATION_SERVICE, KSERVE_SERVICE)),  # undecodable: INVALID_ARGUMENT
            ],
            options=[
                ("grpc.max_receive_message_length", self.served.max_request_bytes),
                ("grpc.so_reuseport", 0),  # a port already in use is an error, not a second silent listener
            ],
        )
        generation_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(service, self.served), server)
        kserve_pb2_grpc.add_GRPCInferenceServiceServicer_to_server(
            InferenceServicer(service, KServeModel(self.served)), server
        )
        health_pb2_grpc.add_HealthServicer_to_server(self._health, server)
        names = (GENERATION_SERVICE, KSERVE_SERVICE, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name,
                 reflection.SERVICE_NAME)  # fmt: skip
        reflection.enable_server_reflection(names, server, pool=reflection_pool())
        try:
            port = server.add_insecure_port(self.address)
        except RuntimeError as exc:
            raise OSError(f"cannot bind gRPC to {self.address}: {exc}") from None
        if port == 0:
            raise OSError(f"cannot bind gRPC to {self.address}")
        await server.start()
        self._server, self.port = server, port
        await self._set_health(True)
        self._watch = asyncio.ensure_future(self._watch_engine())
        logger.info("gRPC serving %s and %s on port %d", GENERATION_SERVICE, KSERVE_SERVICE, port)
        return port

    async def stop(self, grace: float | None) -> None:
        """Health goes NOT_SERVING, new RPCs are refused, those in flight get `grace` seconds (None: none) to
        finish; the rest are cancelled, which aborts their requests."""
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        await self._health.enter_graceful_shutdown()
        if self._server is not None:
            await self._server.stop(grace)

    async def _set_health(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in ("", GENERATION_SERVICE, KSERVE_SERVICE):
            await self._health.set(name, status)

    async def _watch_engine(self) -> None:
        """NOT_SERVING while the engine loop is dead or stalled (as /health answers 503), SERVING again after."""
        serving = True
        while True:
            await asyncio.sleep(HEALTH_CHECK_INTERVAL_S)
            try:
                now = await self.health_problem() is None
            except Exception:  # noqa: BLE001 - cannot tell: not serving
                now = False
            if now != serving:
                serving = now
                await self._set_health(serving)

    async def _local_engine_problem(self) -> str | None:
        engine = self.engine
        if not isinstance(engine, AsyncLLMEngine | EngineCoreClient):
            return None
        if engine.is_running and engine.stalled_for() <= self.stall_timeout_s:
            return None
        return "the engine loop is dead or stalled"


def reflection_pool() -> descriptor_pool.DescriptorPool:
    """One pool holding every served file, for reflection: the KServe messages live in a private pool of their own
    (see codegen.py), so the default pool would not find them."""
    pool = descriptor_pool.DescriptorPool()
    for module in (generation_pb2, kserve_pb2, health_pb2, reflection_pb2):
        proto = descriptor_pb2.FileDescriptorProto()
        module.DESCRIPTOR.CopyToProto(proto)
        pool.Add(proto)
    return pool
