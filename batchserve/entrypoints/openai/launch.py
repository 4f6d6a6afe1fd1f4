"""`batchserve serve`: the command line, and uvicorn run until SIGTERM/SIGINT with a drain of in-flight requests;
with --grpc-port, the gRPC front end (batchserve.v1.Generation and KServe v2) on the same event loop and engine."""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import logging
import signal
import socket
import sys
import threading
from types import FrameType

import uvicorn
from fastapi import FastAPI

from batchserve import env
from batchserve.config import ConfigError
from batchserve.engine.async_engine import AsyncLLMEngine
from batchserve.engine.core_client import EngineCoreClient, EngineCoreStartError
from batchserve.engine.llm_engine import LLMEngine
from batchserve.entrypoints.engine_args import ArgumentParser, add_engine_arguments, engine_config_from_args
from batchserve.entrypoints.grpc.server import GrpcServer
from batchserve.entrypoints.openai.app import DEFAULT_MODEL_NAME, DEFAULT_STALL_TIMEOUT_S, build_app
from batchserve.entrypoints.openai.chat_options import add_chat_arguments, apply_chat_options
from batchserve.entrypoints.openai.connections import (
    DEFAULT_BODY_READ_TIMEOUT_S,
    DEFAULT_BODY_TIMEOUT_S,
    DEFAULT_HEADER_TIMEOUT_S,
    DEFAULT_KEEP_ALIVE_TIMEOUT_S,
    ConnectionLimits,
)
from batchserve.entrypoints.openai.error_delay import (
    DEFAULT_ERROR_DELAY_AFTER,
    DEFAULT_ERROR_DELAY_CLIENTS,
    DEFAULT_ERROR_DELAY_MAX_S,
    ErrorDelayConfig,
    OffenderTable,
)
from batchserve.entrypoints.openai.front import DEFAULT_MAX_BODY_BYTES
from batchserve.entrypoints.openai.observability import add_observability_arguments, observability_from_args
from batchserve.host.heap import start_memory_trace
from batchserve.host.process import configure_torch

logger = logging.getLogger("batchserve.server")

DEFAULT_DRAIN_TIMEOUT_S = 30.0
GRPC_GRACE_MARGIN_S = 5.0  # past the drain deadline, for aborted RPCs to send their status
GRPC_NO_DEADLINE_S = 365 * 24 * 3600.0
SECOND_SIGNAL_GRACE_S = 1.0


def make_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="batchserve serve", description="OpenAI-compatible HTTP server (continuous batching, paged KV cache)"
    )
    parser.add_argument(
        "model", nargs="?", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000, help="HTTP port")
    parser.add_argument(
        "--grpc-port", type=int, default=None, help="also serve gRPC (batchserve.v1.Generation, KServe v2) on this port"
    )
    parser.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (or env BATCHSERVE_API_KEY)"
    )
    parser.add_argument(
        "--api-key-protects-metrics", action="store_true",
        help="with --api-key, /metrics needs the key too (default: open, as Prometheus scrapers expect)",
    )  # fmt: skip
    parser.add_argument(
        "--served-model-name", default=None, help="name clients use (comma-separated aliases allowed; first reported)"
    )
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413")
    add_chat_arguments(parser)  # --tool-call-parser, --reasoning-parser, --chat-template
    parser.add_argument(
        "--lenient",
        action="store_true",
        help="drop request fields the server does not act on with a logged warning (default: answer 400 naming them)",
    )
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=DEFAULT_DRAIN_TIMEOUT_S,
        help="on SIGTERM/SIGINT wait this long (seconds) for in-flight requests, then abort the rest and exit 1 "
        f"(default: {DEFAULT_DRAIN_TIMEOUT_S:g})",
    )
    parser.add_argument(
        "--stall-timeout",
        type=float,
        default=DEFAULT_STALL_TIMEOUT_S,
        help="/health answers 503 once the engine loop has made no progress this long with requests pending "
        f"(default: {DEFAULT_STALL_TIMEOUT_S:g} s)",
    )
    parser.add_argument(
        "--disable-frontend-multiprocessing", action="store_true",
        help="run the engine core (scheduler, step loop) in the server's own process, as a thread (default: in a "
        "process of its own, so no step delays /health, a 503 or a stream's next token; docs/processes.md)",
    )  # fmt: skip
    parser.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="server log level",
    )
    add_connection_arguments(parser)
    add_observability_arguments(parser)
    add_scale_out_arguments(parser)
    add_engine_arguments(parser, include_model=False)
    return parser


def add_connection_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("connections (slow or idle clients, too many sockets)")
    group.add_argument(
        "--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT_S,
        help="close a connection whose request headers have not all arrived this long (seconds) after its first "
        f"byte (default: {DEFAULT_HEADER_TIMEOUT_S:g})",
    )  # fmt: skip
    group.add_argument(
        "--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT_S,
        help=f"close a connection whose request body stalls this long between two reads (default: "
        f"{DEFAULT_BODY_TIMEOUT_S:g})",
    )  # fmt: skip
    group.add_argument(
        "--body-read-timeout", type=float, default=DEFAULT_BODY_READ_TIMEOUT_S,
        help="answer 408 and close a connection whose request body has not all arrived this long (seconds) after "
        f"its headers, however steadily it trickles in (default: {DEFAULT_BODY_READ_TIMEOUT_S:g})",
    )  # fmt: skip
    group.add_argument(
        "--keep-alive-timeout",
        type=float,
        default=DEFAULT_KEEP_ALIVE_TIMEOUT_S,
        help=f"close an idle keep-alive connection after this long (default: {DEFAULT_KEEP_ALIVE_TIMEOUT_S:g})",
    )
    group.add_argument(
        "--max-connections", type=int, default=None,
        help="open connections (or requests in progress) over this many are answered 503 (default: no cap)",
    )  # fmt: skip
    group.add_argument(
        "--error-delay-max", type=float, default=DEFAULT_ERROR_DELAY_MAX_S,
        help="a client (peer address) refused with 4xx more than --error-delay-after times lately waits for its next "
        "4xx answers, 0.05 s doubling up to this many seconds; served requests are never delayed; 0: off "
        f"(default: {DEFAULT_ERROR_DELAY_MAX_S:g})",
    )  # fmt: skip
    group.add_argument(
        "--error-delay-after", type=int, default=DEFAULT_ERROR_DELAY_AFTER,
        help="4xx answers a client gets at once before its next ones wait (its count halves every 30 s; default: "
        f"{DEFAULT_ERROR_DELAY_AFTER})",
    )  # fmt: skip
    group.add_argument(
        "--error-delay-clients", type=int, default=DEFAULT_ERROR_DELAY_CLIENTS,
        help=f"clients the offender table remembers, least recently refused dropped first (default: "
        f"{DEFAULT_ERROR_DELAY_CLIENTS})",
    )  # fmt: skip


def offenders_from_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> OffenderTable:
    try:
        return OffenderTable(ErrorDelayConfig(args.error_delay_max, args.error_delay_after, args.error_delay_clients))
    except ValueError as exc:
        parser.error(str(exc))


def connection_limits_from_args(args: argparse.Namespace) -> ConnectionLimits:
    return ConnectionLimits(
        args.header_timeout, args.body_timeout, args.keep_alive_timeout, args.max_connections, args.body_read_timeout,
        args.max_body_bytes,
    )  # fmt: skip


SCALE_OUT_FLAGS = ("--replicas", "--max-replicas", "--ray-address")


def add_scale_out_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of the Ray Serve path (batchserve.distributed.launch, which `batchserve serve` runs when one of
    SCALE_OUT_FLAGS is given); listed here so that `serve --help` shows them."""
    group = parser.add_argument_group("scale-out on Ray Serve (any of --replicas, --max-replicas, --ray-address)")
    group.add_argument("--replicas", type=int, default=None, help="engine replicas behind one OpenAI ingress")
    group.add_argument(
        "--max-replicas", type=int, default=None, help="autoscale between --replicas and this many (engine load)"
    )
    group.add_argument(
        "--target-ongoing-requests", type=float, default=16.0,
        help="autoscaling target: running + waiting engine requests per replica (default: 16)",
    )  # fmt: skip
    group.add_argument(
        "--ray-address", default=None, help="join this Ray cluster (default: start a local Ray instance)"
    )
    group.add_argument(
        "--router", choices=["prefix-aware", "power-of-two"], default="prefix-aware",
        help="prefix-aware: the replica already holding the prompt's prefix, unless overloaded; power-of-two: "
        "Ray Serve's default (default: prefix-aware)",
    )  # fmt: skip
    group.add_argument(
        "--replica-cpus", type=float, default=1.0, help="CPUs Ray reserves per engine replica (default: 1)"
    )
    group.add_argument(
        "--ray-proxy", action="store_true",
        help="HTTP through Ray Serve's proxy (default: the ingress serves --host/--port itself, one hop less)",
    )  # fmt: skip


def wants_scale_out(argv: list[str]) -> bool:
    return any(arg.split("=", 1)[0] in SCALE_OUT_FLAGS for arg in argv)


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or env.api_key()
    try:
        config = engine_config_from_args(args, **({"model": args.model} if args.model else {}))
    except ConfigError as exc:
        parser.error(str(exc))
    offenders = offenders_from_args(parser, args)
    start_memory_trace("api-server")  # BATCHSERVE_MEMORY_TRACE: a debug hook, off by default
    if not is_loopback(args.host) and not api_key:
        logger.warning("binding %s without an API key: anyone who can reach it can use it", args.host)

    try:
        async_engine = start_engine(config, args)
    except EngineCoreStartError as exc:
        logger.error("%s", exc)
        return 1
    names = [n.strip() for n in args.served_model_name.split(",") if n.strip()] if args.served_model_name else None
    observability = observability_from_args(parser, args)  # --otlp-traces-endpoint, --log-format
    app = build_app(
        async_engine,
        served_model_name=names,
        api_key=api_key,
        api_key_protects_metrics=args.api_key_protects_metrics,
        max_body_bytes=args.max_body_bytes,
        stall_timeout_s=args.stall_timeout,
        lenient=args.lenient,
        offenders=offenders,
        **observability,
    )
    apply_chat_options(app.state.front, args, parser)
    app.state.front.body_parser.start_on_first_body()
    grpc_server = None
    if args.grpc_port is not None:
        grpc_server = GrpcServer(
            async_engine, names or [config.model or DEFAULT_MODEL_NAME], host=args.host, port=args.grpc_port,
            api_key=api_key, max_request_bytes=args.max_body_bytes, stall_timeout_s=args.stall_timeout,
            offenders=offenders,
        )  # fmt: skip
    try:
        return serve(app, async_engine, args.host, args.port, args.log_level, args.drain_timeout, grpc_server,
                     json_logs=args.log_format == "json", limits=connection_limits_from_args(args))  # fmt: skip
    finally:
        if observability["tracer"] is not None:
            observability["tracer"].shutdown()  # the spans still batched go out


def start_engine(config, args: argparse.Namespace) -> AsyncLLMEngine | EngineCoreClient:
    """The engine core in a process of its own (the default), or in this one with --disable-frontend-multiprocessing
    (torch's settings are then this process's)."""
    if args.disable_frontend_multiprocessing:
        configure_torch(config.num_threads, config.seed)
        return AsyncLLMEngine(LLMEngine(config))
    return EngineCoreClient.launch(config, log_level=logging.getLevelName(args.log_level.upper()))


def serve(
    app: FastAPI,
    async_engine: AsyncLLMEngine | EngineCoreClient,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    drain_timeout: float | None = DEFAULT_DRAIN_TIMEOUT_S,
    grpc_server: GrpcServer | None = None,
    json_logs: bool = False,
    limits: ConnectionLimits | None = None,
) -> int:
    """Run uvicorn in this (main) thread until SIGTERM/SIGINT; in-flight requests get `drain_timeout` seconds to
    finish (None: forever), then the rest are aborted. Returns 1 if a request was aborted that way (or the gRPC
    port could not be bound), else 0. `grpc_server` starts and drains with uvicorn, on its event loop."""
    # json_logs: the root's JSON handler writes uvicorn's lines too, and the app's access log replaces uvicorn's
    logs = {"log_config": None, "access_log": False} if json_logs else {}
    server = _DrainingServer(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level=log_level,
            timeout_graceful_shutdown=None,
            **logs,
            **(limits or ConnectionLimits()).uvicorn_options(getattr(app.state, "offenders", None)),
        ),
        async_engine,
        drain_timeout,
        grpc_server,
    )
    # uvicorn drains on SIGTERM/SIGINT, then re-raises the signal under the handler found at start: make that a
    # clean exit instead of death by signal.
    previous = {sig: signal.signal(sig, _exit_cleanly) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        server.cancel_deadline()
        aborted = async_engine.shutdown(drain=True)
    if aborted:
        logger.error("the drain deadline aborted %d request(s) still in flight", aborted)
    return 1 if aborted or server.failed else 0


class _DrainingServer(uvicorn.Server):
    """uvicorn's graceful shutdown with a deadline: `drain_timeout` seconds after the first SIGTERM/SIGINT the
    engine aborts what is still in flight, so every open stream ends (with an error event) and the server exits."""

    def __init__(
        self, config: uvicorn.Config, engine: AsyncLLMEngine | EngineCoreClient, drain_timeout: float | None,
        grpc_server: GrpcServer | None = None,
    ) -> None:  # fmt: skip
        super().__init__(config)
        self.engine = engine
        self.drain_timeout = drain_timeout
        self.grpc_server = grpc_server
        self.failed = False
        self._deadline: threading.Timer | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.grpc_server is not None and not self.should_exit:
            try:
                await self.grpc_server.start()
            except OSError as exc:
                logger.error("%s", exc)
                self.failed = self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        """HTTP and gRPC drain side by side; the deadline's aborts end what is left on both (gRPC RPCs then end
        with UNAVAILABLE), so a few seconds past it gRPC stops waiting."""
        if self.grpc_server is None:
            await super().shutdown(sockets)
            return
        grace = GRPC_NO_DEADLINE_S if self.drain_timeout is None else self.drain_timeout + GRPC_GRACE_MARGIN_S
        await asyncio.gather(self.grpc_server.stop(grace), super().shutdown(sockets))

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.should_exit:  # a second signal during the drain: stop now (the convention), aborting what is left
            logger.warning("second signal during the drain: aborting in-flight requests and exiting")
            threading.Thread(target=self.engine.shutdown, kwargs={"drain": False}, daemon=True).start()
            # the aborted streams get a moment to send their error event; a connection that still holds on is cut
            force = threading.Timer(SECOND_SIGNAL_GRACE_S, setattr, args=(self, "force_exit", True))
            force.daemon = True
            force.start()
        if self._deadline is None and self.drain_timeout is not None:
            self._deadline = threading.Timer(self.drain_timeout, self.engine.shutdown, kwargs={"drain": False})
            self._deadline.daemon = True
            self._deadline.start()
        super().handle_exit(sig, frame)

    def cancel_deadline(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()


def _exit_cleanly(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(0)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


if __name__ == "__main__":
    sys.exit(main())
