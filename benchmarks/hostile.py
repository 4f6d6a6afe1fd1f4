"""The hostile-client probes, re-run against `batchserve serve` on loopback (bounded in time), with the
figures that must hold:

    python benchmarks/hostile.py                 # the default model (SmolLM2-135M), about 2 minutes
    python benchmarks/hostile.py --fake          # the tests' model-free engine (steps sleep: no GIL contention)
    python benchmarks/hostile.py --in-process    # the engine core in the server's process, to compare

Rounds: bad bodies (0 5xx), the stop-ids attack (another stream slowed <= 1.2x), the overload (300 clients,
--max-waiting-requests 32: 503 and /health p99 <= 100 ms, measured by a prober in its own process), a normal
stream's TPOT beside looping senders of each hostile body (<= 1.2x; round "tpot": huge logit_bias, stop_token_ids,
a 1 MB JSON Schema, a 7k-token echo scoring request, a 200-deep nesting; with the cores each process used), slow
sockets (closed after --header-timeout), and after each round KV blocks back to 0 and the server's RSS. Prints the
figures and writes them as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import signal
import socket
import statistics
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from batchserve.bench.hostile_bodies import HOSTILE_BODIES
from batchserve.bench.soak import _free_port, rss_mb, wait_ready
from batchserve.entrypoints.openai.protocol import MAX_TOKEN_IDS
from batchserve.sampling_params import MAX_STOP_TOKEN_IDS
from batchserve.serving.metrics import parse_metrics

HEADER_TIMEOUT_S = 2.0  # the server's --header-timeout (--header-timeout here)
COMPLETIONS = "/v1/completions"
FAKE_SERVER = textwrap.dedent(
    """
    import sys
    from batchserve.engine.async_engine import AsyncLLMEngine
    from batchserve.entrypoints.openai.app import build_app
    from batchserve.entrypoints.openai.connections import ConnectionLimits
    from batchserve.entrypoints.openai.front import DEFAULT_MAX_BODY_BYTES
    from batchserve.entrypoints.openai.launch import serve
    from batchserve.engine.core_client import EngineCoreClient
    from tests.server.fakes import fake_engine
    options = dict(delay_s=0.01, max_batch_size=16, max_waiting_requests=32)
    if sys.argv[3] == "in-process":
        engine = AsyncLLMEngine(fake_engine(**options))
    else:
        engine = EngineCoreClient.launch(None, fake_engine, **options)
    # as serve sets it up: oversized bodies refused by the protocol (older checkouts: by the app)
    refusal = {"max_body_bytes": DEFAULT_MAX_BODY_BYTES} if hasattr(ConnectionLimits, "max_body_bytes") else {}
    limits = ConnectionLimits(header_timeout_s=float(sys.argv[2]), **refusal)
    app = build_app(engine)
    parser = getattr(app.state.front, "body_parser", None)  # as serve starts it (absent in older checkouts)
    if parser is not None:
        parser.start()
    sys.exit(serve(app, engine, port=int(sys.argv[1]), log_level="warning", limits=limits))
    """
)


def start(fake: bool, port: int, header_timeout_s: float, in_process: bool = False,
          server_args: list[str] | None = None) -> subprocess.Popen:  # fmt: skip
    """The server, its engine core in a process of its own (the default) or in the server's (`in_process`);
    `server_args`: more flags of `batchserve serve` (the model's server only)."""
    if fake:
        root = Path(__file__).resolve().parents[1]
        mode = "in-process" if in_process else "core-process"
        return subprocess.Popen([sys.executable, "-c", FAKE_SERVER, str(port), str(header_timeout_s), mode], cwd=root)
    return subprocess.Popen([
        sys.executable, "-m", "batchserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "warning", "--max-batch-size", "16", "--max-waiting-requests", "32", "--dtype", "float32",
        "--max-model-len", "512", "--header-timeout", str(header_timeout_s),
        *(["--disable-frontend-multiprocessing"] if in_process else []), *(server_args or []),
    ])  # fmt: skip


# ------------------------------------------------------------------------------------------------ bad bodies
def bad_bodies() -> list[tuple[str, str, dict[str, str]]]:
    """(path, raw body, extra headers): each must be answered 4xx."""
    ok = {"prompt": "hi", "max_tokens": 2}
    bodies = [
        {**ok, "top_k": 10**12}, {**ok, "temperature": 1e6}, {**ok, "logit_bias": {"1_0": 1}},
        {**ok, "logit_bias": {" 1": 1}}, {**ok, "stop_token_ids": list(range(590_000))}, {**ok, "stop": ["x"] * 1000},
        {**ok, "logprobs": 10**6}, {**ok, "n": 10**6}, {**ok, "max_tokens": -1}, {**ok, "prompt": [10**9]},
        {**ok, "prompt": [[1] * 300_000]}, {**ok, "seed": 2**70}, {**ok, "min_p": -1}, {"prompt": 5},
    ]
    raw = [(COMPLETIONS, json.dumps(b), {}) for b in bodies]
    raw += [
        (COMPLETIONS, '{"prompt": "hi", "max_tokens": NaN}', {}), (COMPLETIONS, "[" * 5000 + "]" * 5000, {}),
        (COMPLETIONS, '{"prompt": "\\ud800"}', {}), (COMPLETIONS, "{", {}),
        ("/v1/chat/completions", json.dumps({"messages": [{"role": "user", "content": "x"}],
                                             "response_format": {"json_schema": {}}}), {}),
        ("/detokenize", json.dumps({"tokens": [1] * 300_000}), {}),
        ("/v2/models/ensemble/generate", '{"text_input": ' + "[" * 900 + '"x"' + "]" * 900 + ', "max_tokens": 2}', {}),
        ("/v2/models/ensemble/generate", '{"text_input": "x", "max_tokens": 2, "top_p": 1e400}', {}),
    ]
    return raw


def probe_bad_bodies(url: str) -> dict[str, Any]:
    statuses = []
    with httpx.Client(timeout=60) as client:
        for path, body, headers in bad_bodies():
            statuses.append(client.post(url + path, content=body,
                                        headers={"Content-Type": "application/json", **headers}).status_code)
    return {"bad_bodies": len(statuses), "bad_bodies_5xx": sum(s >= 500 for s in statuses),
            "bad_bodies_2xx": sum(s < 300 for s in statuses)}  # fmt: skip


# ------------------------------------------------------------------------------------------------ stop-ids attack
def stream_seconds(url: str, max_tokens: int = 48) -> float:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=300) as response:
        for _ in response.iter_lines():
            pass
    return time.monotonic() - start


def probe_stop_ids_attack(url: str, attackers: int = 8, repeats: int = 3) -> dict[str, Any]:
    """A victim stream beside `attackers` requests holding the largest stop-id list accepted (min_tokens keeps it
    masked at every step), against the same load without stop ids, alternated `repeats` times (medians): on a
    shared host the load around moves either figure by more than the attack could."""
    attack = {"prompt": "x", "max_tokens": 64, "min_tokens": 64, "ignore_eos": True,
              "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS, 0, -1))}
    plain = {**attack, "stop_token_ids": [], "min_tokens": 0}
    refused = httpx.post(url + COMPLETIONS, json={**attack, "stop_token_ids": list(range(590_000))}, timeout=60)

    async def victim_beside(body: dict[str, Any]) -> float:
        async with httpx.AsyncClient(timeout=300) as client:
            tasks = [asyncio.create_task(client.post(url + COMPLETIONS, json=body)) for _ in range(attackers)]
            await asyncio.sleep(0.3)
            victim = await asyncio.to_thread(stream_seconds, url)
            await asyncio.gather(*tasks)
            return victim

    beside_plain, beside_attack = [], []
    for _ in range(repeats):
        beside_plain.append(asyncio.run(victim_beside(plain)))
        beside_attack.append(asyncio.run(victim_beside(attack)))
    loaded, attacked = statistics.median(beside_plain), statistics.median(beside_attack)
    return {"victim_beside_plain_s": [round(v, 2) for v in beside_plain],
            "victim_beside_attack_s": [round(v, 2) for v in beside_attack],
            "attack_slowdown_vs_same_load": round(attacked / loaded, 3), "590k_stop_ids_status": refused.status_code}


# ------------------------------------------------------------------------------------------------ big detokenize
def largest_gap_s(url: str, max_tokens: int = 32) -> float:
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    gaps, last = [], None
    with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=300) as response:
        for _ in response.iter_lines():
            now = time.monotonic()
            if last is not None:
                gaps.append(now - last)
            last = now
    return max(gaps, default=0.0)


def probe_big_detokenize(url: str, callers: int = 16) -> dict[str, Any]:
    """A stream's largest gap between chunks, alone and beside `callers` concurrent /detokenize of the largest
    token array accepted."""
    alone = statistics.median(largest_gap_s(url, 96) for _ in range(2))
    tokens = [(i * 7919) % 200 for i in range(MAX_TOKEN_IDS)]  # ids every vocabulary here holds

    async def beside() -> float:
        async with httpx.AsyncClient(timeout=300) as client:
            victim = asyncio.create_task(asyncio.to_thread(largest_gap_s, url, 96))
            await asyncio.sleep(0.2)
            replies = await asyncio.gather(*(client.post(url + "/detokenize", json={"tokens": tokens})
                                             for _ in range(callers)))  # fmt: skip
            assert all(r.status_code == 200 for r in replies), [r.status_code for r in replies]
            return await victim

    return {"gap_alone_ms": round(1000 * alone), "gap_beside_detokenize_ms": round(1000 * asyncio.run(beside()))}


# ------------------------------------------------------------------------------------------------ overload
def _load(url: str, clients: int, duration_s: float, out: multiprocessing.Queue, max_tokens: int = 16) -> None:
    async def run() -> dict[str, Any]:
        counts: dict[str, Any] = {}
        refused_s: list[float] = []  # as the load's clients saw their 503s (their own process is busy too)
        deadline = time.monotonic() + duration_s
        limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            async def one_client(i: int) -> None:
                while time.monotonic() < deadline:
                    body = {"prompt": f"client {i} says", "max_tokens": max_tokens, "ignore_eos": True}
                    start = time.monotonic()
                    try:
                        status: int | str = (await client.post(url + COMPLETIONS, json=body)).status_code
                    except httpx.HTTPError as exc:  # by kind: a server that drops connections shows here
                        status = type(exc).__name__
                    counts[str(status)] = counts.get(str(status), 0) + 1
                    if status == 503:
                        refused_s.append(time.monotonic() - start)
                    if status != 200:
                        await asyncio.sleep(0.05)

            await asyncio.gather(*(one_client(i) for i in range(clients)))
        counts["load_503_p50_ms"] = _pct(refused_s, 50)  # type: ignore[assignment]
        counts["load_503_p99_ms"] = _pct(refused_s, 99)  # type: ignore[assignment]
        return counts

    out.put(asyncio.run(run()))


def probe_overload(url: str, clients: int, duration_s: float, max_tokens: int = 16) -> dict[str, Any]:
    context = multiprocessing.get_context("spawn")  # a fresh interpreter: none of this process's threads or locks
    results = context.Queue()
    load = context.Process(target=_load, args=(url, clients, duration_s, results, max_tokens))
    load.start()
    time.sleep(min(3.0, duration_s / 4))  # the queue fills
    deadline = time.monotonic() + duration_s - 3.0
    health: list[float] = []
    refusals: list[float] = []
    other: list[float] = []

    def probe_health() -> None:  # its own thread: a probe request that is admitted does not hold it up
        with httpx.Client(timeout=120) as client:
            while time.monotonic() < deadline:
                start = time.monotonic()
                client.get(url + "/health")
                health.append(time.monotonic() - start)
                time.sleep(0.05)

    def probe_refusal() -> None:
        with httpx.Client(timeout=2.0) as client:  # admitted (the queue had room): given up after 2 s
            while time.monotonic() < deadline:
                start = time.monotonic()
                try:
                    status = client.post(url + COMPLETIONS, json={"prompt": "probe", "max_tokens": 1}).status_code
                except httpx.TimeoutException:
                    status = 0
                (refusals if status == 503 else other).append(time.monotonic() - start)
                time.sleep(0.05)

    probes = [threading.Thread(target=probe_health), threading.Thread(target=probe_refusal)]
    for probe in probes:
        probe.start()
    for probe in probes:
        probe.join()
    counts = results.get(timeout=duration_s + 300)
    load.join()
    return {"clients": clients, "duration_s": duration_s, "load_max_tokens": max_tokens, "load_statuses": counts,
            "health_p50_ms": _pct(health, 50), "health_p99_ms": _pct(health, 99), "health_max_ms": _pct(health, 100),
            "503_p50_ms": _pct(refusals, 50), "503_p99_ms": _pct(refusals, 99), "503_max_ms": _pct(refusals, 100),
            "health_samples": len(health), "probe_503s": len(refusals), "probe_admitted": len(other)}  # fmt: skip


def _pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(1000 * ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))], 1)


# ------------------------------------------------------------------------------------------------ TPOT beside hostile clients
def victim_tpot_s(url: str, max_tokens: int = 24) -> float:
    """A normal stream's time per output token: from its first chunk to its last."""
    body = {"prompt": "Once upon a time", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    times = []
    with httpx.stream("POST", url + COMPLETIONS, json=body, timeout=300) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                times.append(time.monotonic())
    return (times[-1] - times[0]) / max(1, len(times) - 1)


def _attack(url: str, path: str, body: dict[str, Any], clients: int, started: Any, stop: Any,
            out: multiprocessing.Queue) -> None:  # fmt: skip
    async def run() -> dict[str, int]:
        counts: dict[str, int] = {}
        raw = json.dumps(body)
        async with httpx.AsyncClient(timeout=120) as client:
            async def one() -> None:
                while not stop.is_set():
                    try:  # a server may close the connection on a refused body: counted, and sent again
                        status = str((await client.post(url + path, content=raw,
                                                        headers={"content-type": "application/json"})).status_code)
                    except httpx.HTTPError as exc:
                        status = type(exc).__name__
                    counts[status] = counts.get(status, 0) + 1
                    started.set()

            await asyncio.gather(*(one() for _ in range(clients)))
        return counts

    out.put(asyncio.run(run()))


def _stat(pid: int) -> list[str]:
    """/proc/PID/stat's fields from the state on (field 3 is index 0)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(server_pid: int, attackers_pid: int) -> dict[str, float]:
    """CPU seconds used so far by the API server, each of its child processes (the engine core; the body parser,
    whose niceness is higher) and the attackers' process: where a hostile client's cost lands, whatever the load
    around."""
    tick = os.sysconf("SC_CLK_TCK")

    def used(fields: list[str]) -> float:
        return (int(fields[11]) + int(fields[12])) / tick

    totals = {"api_server": used(_stat(server_pid)), "attackers": used(_stat(attackers_pid))}
    for entry in Path("/proc").iterdir():
        try:
            fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        except (OSError, ValueError):
            continue  # gone meanwhile
        if fields and int(fields[1]) == server_pid:
            totals[f"child {entry.name} (nice {fields[16]})"] = used(fields)
    return totals


def probe_tpot_beside_hostile(url: str, server_pid: int, clients: int = 8, repeats: int = 2,
                              bodies: list[str] | None = None, victim_tokens: int = 24) -> dict[str, Any]:  # fmt: skip
    """A normal stream's TPOT alone, then beside `clients` looping senders of each hostile body (a process of their
    own), alternated `repeats` times (medians): the ratio is what the hostile clients cost the stream."""
    context = multiprocessing.get_context("spawn")
    chosen = {name: HOSTILE_BODIES[name] for name in bodies or HOSTILE_BODIES}
    tpot: dict[str, list[float]] = {"alone": [], **{name: [] for name in chosen}}
    statuses: dict[str, dict[str, int]] = {}
    cpu: dict[str, dict[str, float]] = {}
    for _ in range(repeats):
        tpot["alone"].append(victim_tpot_s(url, victim_tokens))
        for name, (path, body) in chosen.items():
            started, stop, results = context.Event(), context.Event(), context.Queue()
            attackers = context.Process(target=_attack, args=(url, path, body, clients, started, stop, results))
            attackers.start()
            started.wait(120)  # the attackers' interpreter has started and a first answer came back
            before, start = cpu_seconds(server_pid, attackers.pid), time.monotonic()
            time.sleep(1.0)  # all of them loop
            tpot[name].append(victim_tpot_s(url, victim_tokens))
            after, wall = cpu_seconds(server_pid, attackers.pid), time.monotonic() - start
            cpu[name] = {who: round((after[who] - before.get(who, 0.0)) / wall, 2) for who in after}  # latest
            stop.set()
            statuses[name] = results.get(timeout=300)
            attackers.join()
    alone = statistics.median(tpot["alone"])
    report: dict[str, Any] = {"clients": clients, "tpot_alone_ms": round(1000 * alone, 1)}
    for name in chosen:
        beside = statistics.median(tpot[name])
        report[name] = {"tpot_ms": round(1000 * beside, 1), "ratio": round(beside / alone, 2),
                        "attacker_statuses": statuses[name], "cores_used": cpu[name]}
    return report


# ------------------------------------------------------------------------------------------------ slow sockets
def probe_slow_sockets(port: int, header_timeout_s: float, count: int = 15) -> dict[str, Any]:
    sockets = []
    for _ in range(count):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.sendall(b"GET /heal")  # half a request line, then nothing
        sock.settimeout(header_timeout_s * 5)
        sockets.append(sock)
    start, closed_after = time.monotonic(), []
    for sock in sockets:
        try:
            while sock.recv(4096):
                pass
            closed_after.append(time.monotonic() - start)
        except TimeoutError:
            pass
        sock.close()
    return {"slow_sockets": count, "slow_sockets_closed": len(closed_after),
            "slow_socket_closed_after_max_s": round(max(closed_after, default=float("nan")), 2)}  # fmt: skip


def cpu_name() -> str:
    """The host's CPU as /proc/cpuinfo names it (figures carry it), and how many cores this process may use."""
    try:
        with open("/proc/cpuinfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        name = " ".join(fields.get("model name\t", "?").split())
    except OSError:
        name = "?"
    return f"{name}, {len(os.sched_getaffinity(0))} cores"


# ------------------------------------------------------------------------------------------------ round checks
def settle(url: str, pid: int, round_name: str, report: dict[str, Any]) -> None:
    deadline = time.monotonic() + 60
    used = None
    while time.monotonic() < deadline:
        metrics = parse_metrics(httpx.get(url + "/metrics", timeout=30).text)
        used = metrics.get("batchserve:kv_cache_blocks_used")
        if used == 0 and not metrics.get("batchserve:num_requests_running"):
            break
        time.sleep(0.5)
    report.setdefault("kv_blocks_after", {})[round_name] = used
    report.setdefault("rss_mb_after", {})[round_name] = round(rss_mb(pid))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fake", action="store_true", help="the tests' model-free engine instead of the model")
    parser.add_argument("--clients", type=int, default=300)
    parser.add_argument("--overload-s", type=float, default=20.0)
    parser.add_argument("--header-timeout", type=float, default=HEADER_TIMEOUT_S)
    parser.add_argument("--load-max-tokens", type=int, default=16, help="max_tokens of the overload's requests")
    parser.add_argument("--rounds", default="bad_bodies,stop_ids,detokenize,overload,slow_sockets",
                        help="comma-separated")
    parser.add_argument("--hostile-bodies", default=",".join(HOSTILE_BODIES),
                        help="round tpot: the hostile bodies sent beside the stream, comma-separated")
    parser.add_argument("--tpot-repeats", type=int, default=2, help="round tpot: alternations (medians)")
    parser.add_argument("--victim-tokens", type=int, default=24,
                        help="round tpot: the stream's output tokens (fewer: a shorter round on a loaded host)")
    parser.add_argument("--server-arg", action="append", default=[], dest="server_args",
                        help="one more flag of `batchserve serve` (repeat it), e.g. --server-arg=--error-delay-max=0")
    parser.add_argument("--output", default="bench_results/hostile.json")
    parser.add_argument("--in-process", action="store_true",
                        help="the engine core in the server's process (--disable-frontend-multiprocessing)")
    args = parser.parse_args(argv)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(args.fake, port, args.header_timeout, args.in_process, args.server_args)
    report: dict[str, Any] = {"engine": "fake" if args.fake else "default model",
                              "engine_core": "in-process" if args.in_process else "own process", "cpu": cpu_name(),
                              "server_args": args.server_args}
    try:
        wait_ready(proc, url)
        report["rss_mb_start"] = round(rss_mb(proc.pid))
        rounds = [("bad_bodies", lambda: probe_bad_bodies(url)), ("stop_ids", lambda: probe_stop_ids_attack(url)),
                  ("detokenize", lambda: probe_big_detokenize(url)),
                  ("overload", lambda: probe_overload(url, args.clients, args.overload_s, args.load_max_tokens)),
                  ("tpot", lambda: probe_tpot_beside_hostile(url, proc.pid, repeats=args.tpot_repeats,
                                                          bodies=args.hostile_bodies.split(","),
                                                          victim_tokens=args.victim_tokens)),
                  ("slow_sockets", lambda: probe_slow_sockets(port, args.header_timeout))]  # fmt: skip
        for name, probe in [(name, probe) for name, probe in rounds if name in args.rounds.split(",")]:
            load_before = os.getloadavg()[0]
            report[name] = probe()
            report[name]["host_load_1min"] = [round(load_before, 1), round(os.getloadavg()[0], 1)]  # before, after
            settle(url, proc.pid, name, report)
            print(name, json.dumps(report[name]), flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        report["exit_code"] = proc.wait(60)
    print(json.dumps(report, indent=2))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
