"""What watching the server costs: the peer64 workload over HTTP against one live server, in rounds that alternate
between everything an operator turns on (request traces to an OTLP receiver on loopback, the JSON access log,
/dashboard/data polled once a second as the page does, a traceparent on every request) and nothing of it (the
dashboard's, the tracer's and the access log's step listeners detached, no polling). Same server, same engine, same
run: only the watching differs. Prints output tok/s of each round and the ratio of the means.

    .venv/bin/python benchmarks/observability_overhead.py --limit 32 --pairs 2
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import socket
import statistics
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import httpx
import torch
import uvicorn

from batchserve.engine.llm_engine import LLMEngine
from batchserve.entrypoints.openai.access_log import AccessLog
from batchserve.entrypoints.openai.app import build_app
from batchserve.serving.tracing import RequestTracer, otlp_exporter, tracer_provider

WORKLOAD = Path(__file__).resolve().parent / "workloads" / "peer64.json"
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class _Sink(BaseHTTPRequestHandler):
    """An OTLP/HTTP receiver that reads and drops what it is sent."""

    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args) -> None:
        pass


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


async def _round(url: str, requests: list[dict], traceparent: bool) -> float:
    headers = {"traceparent": TRACEPARENT} if traceparent else {}
    async with httpx.AsyncClient(timeout=600) as client:

        async def one(r: dict) -> int:
            body = {"prompt": r["prompt_token_ids"], "max_tokens": r["max_tokens"], "ignore_eos": True,
                    "temperature": 0}  # fmt: skip
            reply = await client.post(url + "/v1/completions", json=body, headers=headers)
            reply.raise_for_status()
            return reply.json()["usage"]["completion_tokens"]

        start = time.perf_counter()
        tokens = sum(await asyncio.gather(*(one(r) for r in requests)))
        return tokens / (time.perf_counter() - start)


def _poll(url: str, stop: threading.Event) -> None:
    since = -1
    while not stop.wait(1.0):
        data = httpx.get(url + "/dashboard/data", params={"since": since}, timeout=10).json()
        if data["steps"]:
            since = data["steps"][-1][0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=64, help="the first N requests of peer64")
    p.add_argument(
        "--pairs", type=int, default=2, help="watched/unwatched pairs (alternating, order flipped each pair)"
    )
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--parts",
        default="listeners,poll,traceparent",
        help="what the watched rounds turn on: listeners (dashboard, tracer, access log), poll, traceparent",
    )
    args = p.parse_args()
    requests = json.loads(WORKLOAD.read_text())["requests"][: args.limit]

    sink = HTTPServer(("127.0.0.1", 0), _Sink)
    threading.Thread(target=sink.serve_forever, daemon=True).start()
    torch.set_num_threads(args.threads)
    engine = LLMEngine.from_options(dtype=args.dtype, num_threads=args.threads, max_batch_size=64)
    quiet = logging.getLogger("overhead.access")
    quiet.addHandler(logging.NullHandler())
    quiet.propagate = False
    tracer = RequestTracer(tracer_provider(otlp_exporter(f"127.0.0.1:{sink.server_port}")))
    app = build_app(engine, tracer=tracer, access_log=AccessLog(quiet))
    async_engine = app.state.async_engine
    watchers = [app.state.live_stats.on_step, tracer.on_step, app.state.access_log.on_step]
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url = f"http://127.0.0.1:{port}"
    # warm-up: one whole round, unmeasured (the first round of a run, watched or not, is its slowest: kernels and
    # allocations meet each of the workload's shapes for the first time)
    asyncio.run(_round(url, requests, True))

    results: dict[bool, list[float]] = {True: [], False: []}
    for pair in range(args.pairs):
        for watched in (True, False) if pair % 2 == 0 else (False, True):
            listeners = async_engine.step_listeners
            on = set(args.parts.split(",")) if watched else set()
            listeners[:] = [fn for fn in listeners if fn not in watchers] + (watchers if "listeners" in on else [])
            stop = threading.Event()
            poller = threading.Thread(target=_poll, args=(url, stop), daemon=True)
            if "poll" in on:
                poller.start()
            rate = asyncio.run(_round(url, requests, "traceparent" in on))
            stop.set()
            results[watched].append(rate)
            print(f"pair {pair} {'watched  ' if watched else 'unwatched'}: {rate:.1f} output tok/s", flush=True)
    server.should_exit = True
    tracer.shutdown()
    with_, without = statistics.mean(results[True]), statistics.mean(results[False])
    print(f"watched / unwatched: {with_:.1f} / {without:.1f} tok/s = {with_ / without:.4f}")


if __name__ == "__main__":
    main()
