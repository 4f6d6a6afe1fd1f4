"""`batchserve serve`: the command line, and uvicorn run until SIGTERM/SIGINT with a drain of in-flight requests."""

from __future__ import annotations

import argparse
import ipaddress
import logging
import signal
import socket
import sys
from types import FrameType

import uvicorn
from fastapi import FastAPI

from batchserve import env
from batchserve.config import ConfigError
from batchserve.engine.async_engine import AsyncLLMEngine
from batchserve.engine.llm_engine import LLMEngine
from batchserve.entrypoints.engine_args import add_engine_arguments, engine_config_from_args
from batchserve.entrypoints.openai.app import build_app
from batchserve.entrypoints.openai.front import DEFAULT_MAX_BODY_BYTES
from batchserve.worker.device import configure_torch

logger = logging.getLogger("batchserve.server")


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="batchserve serve", description="OpenAI-compatible HTTP server (continuous batching, paged KV cache)"
    )
    parser.add_argument(
        "model", nargs="?", default=None, help="HF directory or .gguf file (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--api-key", default=None, help="require 'Authorization: Bearer KEY' (or env BATCHSERVE_API_KEY)"
    )
    parser.add_argument(
        "--served-model-name", default=None, help="name clients use (comma-separated aliases allowed; first reported)"
    )
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get 413")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        help="on SIGTERM wait this long for in-flight requests (default: forever)",
    )
    parser.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_arguments(parser, include_model=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = args.api_key or env.api_key()
    try:
        config = engine_config_from_args(args, **({"model": args.model} if args.model else {}))
    except ConfigError as exc:
        parser.error(str(exc))
    if not is_loopback(args.host) and not api_key:
        logger.warning("binding %s without an API key: anyone who can reach it can use it", args.host)

    configure_torch(config.num_threads, config.seed)
    async_engine = AsyncLLMEngine(LLMEngine(config))
    names = [n.strip() for n in args.served_model_name.split(",") if n.strip()] if args.served_model_name else None
    app = build_app(async_engine, served_model_name=names, api_key=api_key, max_body_bytes=args.max_body_bytes)
    return serve(app, async_engine, args.host, args.port, args.log_level, args.drain_timeout)


def serve(
    app: FastAPI,
    async_engine: AsyncLLMEngine,
    host: str = "127.0.0.1",
    port: int = 8000,
    log_level: str = "info",
    drain_timeout: float | None = None,
) -> int:
    """Run uvicorn in this (main) thread until SIGTERM/SIGINT; in-flight requests finish first (drain)."""
    server = uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=drain_timeout)
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
        async_engine.shutdown(drain=True)
    return 0


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
