"""A live gRPC front end on loopback for tests: GrpcServer on an event loop of its own in a thread, on a port the
OS picks, over the AsyncLLMEngine of a LiveServer (HTTP and gRPC on one engine, as `batchserve serve --grpc-port`)
or one of its own."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from typing import Any

import grpc

from batchserve.engine.async_engine import AsyncLLMEngine
from batchserve.entrypoints.grpc.pb import generation_pb2_grpc
from batchserve.entrypoints.grpc.server import GrpcServer
from batchserve.entrypoints.kserve.pb import kserve_pb2_grpc


class LiveGrpc:
    def __init__(self, engine: AsyncLLMEngine, names: Sequence[str] = ("fake",), **options: Any) -> None:
        self.engine = engine
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="grpc-test-loop", daemon=True)
        self.thread.start()
        self.server = GrpcServer(engine, names, **options)
        self.port = self._run(self.server.start())
        self.target = f"127.0.0.1:{self.port}"
        self.channel = grpc.insecure_channel(self.target)
        self.generation = generation_pb2_grpc.GenerationStub(self.channel)
        self.kserve = kserve_pb2_grpc.GRPCInferenceServiceStub(self.channel)

    def _run(self, coro: Any, timeout: float = 60) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self, grace: float | None = None) -> None:
        self.channel.close()
        self._run(self.server.stop(grace))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(30)
        self.loop.close()
