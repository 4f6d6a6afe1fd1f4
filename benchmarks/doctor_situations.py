"""`batchserve doctor` against a real server (the default model) in each situation it knows, and in a healthy one:
for each, a server configured into the situation, load sent over HTTP on a schedule, doctor watching through
/dashboard/data for the window; prints the findings and whether the expected one (and no other on the healthy run)
came out.

    .venv/bin/python benchmarks/doctor_situations.py                       # every situation (a few minutes)
    .venv/bin/python benchmarks/doctor_situations.py --only healthy,kv_starved --window 20
"""

from __future__ import annotations

import argparse
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx
import torch
import uvicorn

from batchserve.doctor.cli import render
from batchserve.doctor.observe import http_fetcher, watch
from batchserve.doctor.rules import diagnose
from batchserve.engine.llm_engine import LLMEngine
from batchserve.entrypoints.openai.app import build_app


@dataclass
class Situation:
    options: dict[str, Any]  # engine options
    rate: float  # requests/s
    prompt_len: int
    output_len: int
    expected: set[str]  # rules that must be found (empty: none at all)
    long_every: int = 0  # every n-th request gets a long prompt
    long_len: int = 0
    base: dict[str, Any] = field(default_factory=lambda: {"dtype": "float32", "max_model_len": 512})


SITUATIONS = {
    "healthy": Situation({"max_batch_size": 16}, 1.0, 48, 16, set()),
    "queue_backed_up": Situation({"max_batch_size": 2}, 4.0, 32, 24, {"queue_backed_up"}),
    "arrivals_exceed": Situation({"max_batch_size": 32}, 24.0, 32, 16, {"arrivals_exceed"}),
    # a pool of 12 blocks for 16 sequences: full before the token budget, and preempting over and over
    "kv_starved": Situation({"max_batch_size": 16, "num_kv_blocks": 12}, 4.0, 40, 48, {"kv_full", "preemption_thrash"}),
    "long_prompts": Situation(
        {"max_batch_size": 16, "max_num_tokens": 32}, 2.0, 12, 8, {"long_prompts"}, long_every=8, long_len=400
    ),  # fmt: skip
}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _send(url: str, situation: Situation, duration_s: float, stop: threading.Event) -> None:
    rng = random.Random(0)
    pool = ThreadPoolExecutor(64)
    start, i = time.monotonic(), 0
    while not stop.is_set() and time.monotonic() - start < duration_s:
        n = situation.long_len if situation.long_every and i % situation.long_every == 3 else situation.prompt_len
        body = {"prompt": [rng.randrange(100, 40000) for _ in range(n)], "max_tokens": situation.output_len,
                "ignore_eos": True, "temperature": 0}  # fmt: skip
        pool.submit(httpx.post, url + "/v1/completions", json=body, timeout=600)
        i += 1
        stop.wait(rng.expovariate(situation.rate))
    pool.shutdown(wait=False, cancel_futures=True)


def run(name: str, situation: Situation, window_s: float, warmup_s: float) -> bool:
    engine = LLMEngine.from_options(**situation.base, **situation.options)
    app = build_app(engine)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    url, stop = f"http://127.0.0.1:{port}", threading.Event()
    sender = threading.Thread(target=_send, args=(url, situation, warmup_s + window_s, stop), daemon=True)
    sender.start()
    time.sleep(warmup_s)
    obs = watch(http_fetcher(url), window_s)
    stop.set()
    app.state.async_engine.shutdown(drain=False)
    server.should_exit = True
    diagnosis = diagnose(obs)
    found = {f.rule for f in diagnosis.findings}
    ok = found == set() if not situation.expected else situation.expected <= found
    print(f"\n=== {name}: expected {sorted(situation.expected) or 'no finding'}, found {sorted(found) or 'none'}: "
          f"{'OK' if ok else 'MISSED'}")  # fmt: skip
    print(render(obs, diagnosis), flush=True)
    return ok


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default=",".join(SITUATIONS), help="situations to run (comma-separated)")
    p.add_argument("--window", type=float, default=20.0, help="seconds doctor watches each")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before doctor starts watching")
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    results = {name: run(name, SITUATIONS[name], args.window, args.warmup) for name in args.only.split(",")}
    print("\n" + ", ".join(f"{name}: {'OK' if ok else 'MISSED'}" for name, ok in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
