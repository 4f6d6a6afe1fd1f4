"""What one refusal of each hostile body costs the server in CPU time, for a repeat offender: the body sent N times
one after another from one client (which waits for each answer), the CPU seconds the API server process and each
of its children (the engine core, the body parser) used over them, divided by N. CPU time from /proc is what the
load around does not change, where a stream's wall-clock ratio on a shared host does.

    python benchmarks/refusal_cost.py --fake            # the tests' model-free engine (refusals never reach it)
    python benchmarks/refusal_cost.py                   # `batchserve serve` with the default model

Before the bodies, the client makes itself a repeat offender (small bad requests past `--error-delay-after`) and
sends large valid bodies until the body parser process has started and the server is idle (that start's CPU is
reported on its own, as `start_cpu_ms`). The delay cap is lowered (`--error-delay-max`, default 0.05 s here) so that the
run is short; what a refusal costs does not depend on how long its answer waited. `--vary`: each send differs
(a `user` field counting up), as from an offender that defeats a memory of refused bodies.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx

from batchserve.bench.hostile_bodies import HOSTILE_BODIES
from batchserve.bench.soak import _free_port, wait_ready

FAKE_SERVER = textwrap.dedent(
    """
    import sys
    from batchserve.entrypoints.openai.app import build_app
    from batchserve.entrypoints.openai.connections import ConnectionLimits
    from batchserve.entrypoints.openai.error_delay import ErrorDelayConfig, OffenderTable
    from batchserve.entrypoints.openai.front import DEFAULT_MAX_BODY_BYTES
    from batchserve.entrypoints.openai.launch import serve
    from batchserve.engine.core_client import EngineCoreClient
    from tests.server.fakes import fake_engine
    engine = EngineCoreClient.launch(None, fake_engine, delay_s=0.01, max_batch_size=16, max_waiting_requests=32)
    offenders = OffenderTable(ErrorDelayConfig(max_delay_s=float(sys.argv[2]), after=int(sys.argv[3])))
    app = build_app(engine, offenders=offenders)
    app.state.front.body_parser.start_on_first_body()  # as serve does
    limits = ConnectionLimits(max_body_bytes=DEFAULT_MAX_BODY_BYTES)
    sys.exit(serve(app, engine, port=int(sys.argv[1]), log_level="warning", limits=limits))
    """
)
BAD_SMALL = {"prompt": "x", "max_tokens": -1}


def start(fake: bool, port: int, delay_max_s: float, after: int) -> subprocess.Popen:
    if fake:
        root = Path(__file__).resolve().parents[1]
        return subprocess.Popen([sys.executable, "-c", FAKE_SERVER, str(port), str(delay_max_s), str(after)], cwd=root)
    return subprocess.Popen([
        sys.executable, "-m", "batchserve.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
        "--log-level", "warning", "--dtype", "float32", "--max-model-len", "512",
        "--error-delay-max", str(delay_max_s), "--error-delay-after", str(after),
    ])  # fmt: skip


def _stat(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def tree_cpu_s(server_pid: int) -> dict[str, float]:
    """CPU seconds so far of the server process ("api_server") and of each child, by the child's role: "parser"
    for the one at a higher niceness, else "child PID"."""
    tick = os.sysconf("SC_CLK_TCK")

    def used(fields: list[str]) -> float:
        return (int(fields[11]) + int(fields[12])) / tick

    server = _stat(server_pid)
    totals = {"api_server": used(server)}
    for entry in Path("/proc").iterdir():
        try:
            fields = _stat(int(entry.name)) if entry.name.isdigit() else None
        except (OSError, ValueError):
            continue  # gone meanwhile
        if fields and int(fields[1]) == server_pid:
            role = "parser" if int(fields[16]) > int(server[16]) else f"child {entry.name}"
            totals[role] = totals.get(role, 0.0) + used(fields)
    return totals


def _delta(before: dict[str, float], after: dict[str, float], per: int) -> dict[str, float]:
    return {who: round(1000 * (after[who] - before.get(who, 0.0)) / per, 2) for who in after}


def warm_up(client: httpx.Client, server_pid: int, after: int, settle_s: float = 60.0) -> dict[str, float]:
    """Make the client a repeat offender, start the parser process with a large valid body that imports what its
    checks need (a constraint), and wait until the server's processes are idle: the CPU that start costs."""
    before = tree_cpu_s(server_pid)
    for _ in range(after + 2):
        client.post("/v1/completions", json=BAD_SMALL)
    schema = {"type": "object", "properties": {"a": {"type": "string"}}}
    large = {"prompt": "x", "max_tokens": 1, "user": "u" * 100_000,
             "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}}}  # fmt: skip
    deadline, last = time.monotonic() + settle_s, None
    while time.monotonic() < deadline:
        client.post("/v1/completions", json=large)
        time.sleep(1.0)
        now = tree_cpu_s(server_pid)
        if "parser" in now and last is not None and now["parser"] == last.get("parser"):
            break
        last = now
    return _delta(before, tree_cpu_s(server_pid), 1)


def _sends(body: dict, repeats: int, vary: bool) -> list[bytes]:
    if not vary:
        return [json.dumps(body).encode()] * repeats
    return [json.dumps({**body, "user": f"offender-{i}"}).encode() for i in range(repeats)]


def measure(url: str, server_pid: int, bodies: list[str], repeats: int, after: int, vary: bool) -> dict[str, object]:
    report: dict[str, object] = {}
    with httpx.Client(base_url=url, timeout=120) as client:
        report["start_cpu_ms"] = warm_up(client, server_pid, after)
        for name in bodies:
            path, body = HOSTILE_BODIES[name]
            before, statuses = tree_cpu_s(server_pid), {}
            for send in _sends(body, repeats, vary):
                code = str(client.post(path, content=send, headers={"content-type": "application/json"}).status_code)
                statuses[code] = statuses.get(code, 0) + 1
            report[name] = {"bytes": len(json.dumps(body)), "statuses": statuses,
                            "cpu_ms_per_refusal": _delta(before, tree_cpu_s(server_pid), repeats)}  # fmt: skip
            print(name, json.dumps(report[name]), flush=True)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fake", action="store_true", help="the tests' model-free engine instead of the model")
    parser.add_argument("--repeats", type=int, default=20, help="refusals measured per body")
    parser.add_argument("--bodies", default=",".join(HOSTILE_BODIES), help="comma-separated, in this order")
    parser.add_argument("--error-delay-max", type=float, default=0.05)
    parser.add_argument("--error-delay-after", type=int, default=10)
    parser.add_argument("--vary", action="store_true", help="every send of a body differs (a `user` field)")
    parser.add_argument("--output", default="bench_results/refusal_cost.json")
    args = parser.parse_args(argv)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = start(args.fake, port, args.error_delay_max, args.error_delay_after)
    try:
        wait_ready(proc, url)
        report = {"engine": "fake" if args.fake else "default model", "vary": args.vary,
                  "load_1min_before": os.getloadavg()[0],
                  **measure(url, proc.pid, args.bodies.split(","), args.repeats, args.error_delay_after, args.vary)}  # fmt: skip
        report["load_1min_after"] = os.getloadavg()[0]
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(report, indent=2))
    print(json.dumps({"load_1min": [report["load_1min_before"], report["load_1min_after"]]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
