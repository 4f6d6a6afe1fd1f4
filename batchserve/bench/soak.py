"""A soak of the HTTP server as a hostile crowd would use it: `batchserve serve` in its own process (loopback only,
a small KV pool so preemption happens), many streaming and non-streaming clients with random lengths and
priorities, a share of them killed mid-stream, bad requests mixed in. Bounded in requests and in time.

At the end it checks what must hold: no KV block held, no request left running or waiting, no 5xx but 503, every
accepted request finished or aborted by its own client, RSS growth within a bound, and a clean exit on SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx

from batchserve.bench.corpus import CORPUS
from batchserve.bench.hostile_bodies import slow_body, soak_mix
from batchserve.bench.proc_memory import late_slope, rss_by_role, rss_mb, slopes_by_role
from batchserve.serving.metrics import parse_metrics

# Bodies no server should accept; each must get a 4xx and leave the server serving.
BAD_BODIES: list[bytes] = [
    b'{"prompt": "a", "max_tokens": -1}',
    b'{"prompt": "a", "temperature": "hot"}',
    b'{"prompt": "\\ud800 lone surrogate"}',
    b'{"prompt": "a", "top_p": NaN}',
    b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}",
    b'{"messages": [{"role": "wizard", "content": "x"}]}',
    b'{"prompt": "a", "stop": ""}',
    b'{"prompt": [999999999]}',
    b'{"prompt": "a", "logprobs": 99}',
    b"not json at all",
]


@dataclass
class SoakOptions:
    num_requests: int = 400
    duration_s: float = 120.0  # the load stops at whichever comes first
    concurrency: int = 16
    kill_fraction: float = 0.25  # streams the client drops mid-way
    bad_fraction: float = 0.05
    # the reliability probes' bodies (bench/hostile_bodies.py: huge lists and schemas, deep nesting, 7k-token
    # scoring, out-of-vocabulary ids, lone surrogates) and a body trickled a byte at a time
    hostile_fraction: float = 0.0
    max_prompt_words: int = 80
    max_tokens: int = 48
    num_kv_blocks: int = 64
    block_size: int = 16
    max_batch_size: int = 16
    max_waiting_requests: int = 64
    max_rss_growth_mb: float = 150.0  # after the warm-up share of the load (allocator and kernel caches fill there)
    # the most any process of the server's tree may grow per 1,000 requests over the second half (RSS, least
    # squares); 0: not checked (a short soak is still filling its caches)
    max_slope_mb_per_1000: float = 0.0
    warmup_share: float = 0.1  # of the requests or of the duration, whichever comes first
    rss_sample_every: int = 100  # requests between two points of the RSS timeline
    model: str | None = None
    seed: int = 0
    # the same load (same seed: the same requests) this many times against one server: a leak grows in every round,
    # caches that fill grow in the first only
    rounds: int = 1
    extra_server_args: list[str] = field(default_factory=list)


@dataclass
class SoakReport:
    counts: Counter = field(default_factory=Counter)
    ttfts: list[float] = field(default_factory=list)
    rss_start_mb: float = 0.0
    rss_warm_mb: float = 0.0  # once the warm-up share of the load is through
    rss_peak_mb: float = 0.0
    rss_end_mb: float = 0.0
    # (requests sent, seconds since the load began, RSS, its anonymous part, its file-backed part), in MB
    rss_timeline: list[tuple[int, float, float, float, float]] = field(default_factory=list)
    # (requests sent, RSS of the server and every process under it: engine core, body parser, grammar workers), MB
    rss_tree_timeline: list[tuple[int, float]] = field(default_factory=list)
    # (requests sent, {role: (RSS, its anonymous part)}) for each process of the tree by role (bench/proc_memory.py)
    rss_by_process_timeline: list[tuple[int, dict[str, tuple[float, float]]]] = field(default_factory=list)
    hostile: dict[str, Counter] = field(default_factory=dict)  # each hostile body's answers by status
    rss_rounds: list[tuple[float, float]] = field(default_factory=list)  # RSS before and after each round, MB
    leaked_blocks: float = -1.0
    left_running: float = -1.0
    left_waiting: float = -1.0
    exit_code: int | None = None
    wall_s: float = 0.0
    failures: list[str] = field(default_factory=list)

    @property
    def rss_slope_mb_per_1000(self) -> float:
        """RSS growth per 1,000 requests over the timeline's second half (least squares): a leak keeps a slope as
        requests go on; caches that fill flatten it."""
        return late_slope([(p[0], p[2]) for p in self.rss_timeline])

    @property
    def rss_tree_slope_mb_per_1000(self) -> float:
        """The same over the server's whole process tree."""
        return late_slope(self.rss_tree_timeline)

    @property
    def rss_slopes_by_process(self) -> dict[str, tuple[float, float]]:
        """Each process role's (RSS, anonymous) slope over the second half, MB per 1,000 requests."""
        return slopes_by_role(self.rss_by_process_timeline)

    @property
    def ttft_p99_s(self) -> float:
        return statistics.quantiles(self.ttfts, n=100)[98] if len(self.ttfts) >= 2 else float("nan")

    def as_dict(self) -> dict[str, Any]:
        return {
            "counts": dict(self.counts),
            "ttft_p50_s": statistics.median(self.ttfts) if self.ttfts else None,
            "ttft_p99_s": self.ttft_p99_s,
            "rss_start_mb": self.rss_start_mb,
            "rss_warm_mb": self.rss_warm_mb,
            "rss_peak_mb": self.rss_peak_mb,
            "rss_end_mb": self.rss_end_mb,
            "rss_slope_mb_per_1000_requests": self.rss_slope_mb_per_1000,
            "rss_timeline": self.rss_timeline,
            "rss_tree_slope_mb_per_1000_requests": self.rss_tree_slope_mb_per_1000,
            "rss_tree_timeline": self.rss_tree_timeline,
            "rss_slopes_by_process_mb_per_1000_requests": self.rss_slopes_by_process,
            "rss_by_process_timeline": self.rss_by_process_timeline,
            "hostile": {name: dict(statuses) for name, statuses in self.hostile.items()},
            "rss_rounds": self.rss_rounds,
            "leaked_blocks": self.leaked_blocks,
            "left_running": self.left_running,
            "left_waiting": self.left_waiting,
            "exit_code": self.exit_code,
            "wall_s": self.wall_s,
            "failures": self.failures,
        }


# ---------------------------------------------------------------------------------------------------- server
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(options: SoakOptions, port: int) -> subprocess.Popen:
    command = [
        sys.executable, "-m", "batchserve.cli", "serve", *([options.model] if options.model else []),
        "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
        "--num-kv-blocks", str(options.num_kv_blocks), "--block-size", str(options.block_size),
        "--max-batch-size", str(options.max_batch_size), "--max-waiting-requests", str(options.max_waiting_requests),
        "--scheduling-order", "priority", "--dtype", "float32", *options.extra_server_args,
    ]  # fmt: skip
    return subprocess.Popen(command)


def wait_ready(proc: subprocess.Popen, url: str, timeout_s: float = 300.0) -> None:
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as http:  # one client: httpx.get() makes one (and its TLS context) per call, ~30 ms
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with {proc.returncode} before it was ready")
            try:
                if http.get(url + "/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
    raise TimeoutError("the server did not become ready")


# ---------------------------------------------------------------------------------------------------- clients
class SoakClients:
    def __init__(self, url: str, options: SoakOptions, report: SoakReport) -> None:
        self.url, self.options, self.report = url, options, report
        self.rng = random.Random(options.seed)
        self.words = CORPUS.split()
        self.hostile_mix = soak_mix() if options.hostile_fraction > 0 else []

    def _prompt(self) -> str:
        n = self.rng.randint(1, self.options.max_prompt_words)
        start = self.rng.randrange(len(self.words))
        return " ".join(self.words[(start + i) % len(self.words)] for i in range(n))

    async def one(self, client: httpx.AsyncClient, index: int) -> None:
        rng, counts = self.rng, self.report.counts
        if rng.random() < self.options.hostile_fraction:
            await self._hostile(client)
            return
        if rng.random() < self.options.bad_fraction:
            body = rng.choice(BAD_BODIES)
            response = await client.post("/v1/completions", content=body, headers={"content-type": "application/json"})
            counts["bad_rejected" if 400 <= response.status_code < 500 else f"bad_answered_{response.status_code}"] += 1
            return
        chat = rng.random() < 0.5
        body: dict[str, Any] = {
            "max_tokens": rng.randint(1, self.options.max_tokens),
            "priority": rng.randint(0, 3),
            "temperature": rng.choice([0.0, 0.7]),
            "stream": rng.random() < 0.75,
        }
        if chat:
            body["messages"] = [{"role": "user", "content": self._prompt()}]
        else:
            body["prompt"] = self._prompt()
        path = "/v1/chat/completions" if chat else "/v1/completions"
        kill_after = rng.randint(0, 8) if body["stream"] and rng.random() < self.options.kill_fraction else None
        if body["stream"]:
            await self._stream(client, path, body, kill_after)
        else:
            response = await client.post(path, json=body)
            self._count(response.status_code, finished=response.status_code == 200)

    async def _hostile(self, client: httpx.AsyncClient) -> None:
        """One of the hostile bodies (or, as often as any one of them, a body trickled a byte at a time)."""
        pick = self.rng.randrange(len(self.hostile_mix) + 1)
        if pick == len(self.hostile_mix):
            name, host_port = "slow_body", client.base_url
            status = await slow_body(host_port.host, host_port.port)
        else:
            name, path, raw = self.hostile_mix[pick]
            response = await client.post(path, content=raw, headers={"content-type": "application/json"})
            status = response.status_code
        self.report.hostile.setdefault(name, Counter())[str(status)] += 1
        kind = "refused" if 400 <= status < 500 else "served" if status == 200 else f"answered_{status}"
        self.report.counts["overloaded_503" if status == 503 else f"hostile_{kind}"] += 1

    async def _stream(self, client: httpx.AsyncClient, path: str, body: dict, kill_after: int | None) -> None:
        counts, start = self.report.counts, time.monotonic()
        async with client.stream("POST", path, json=body) as response:
            if response.status_code != 200:
                await response.aread()
                self._count(response.status_code, finished=False)
                return
            counts["accepted"] += 1
            chunks, first, finished = 0, None, False
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    counts[f"stream_error_{event['error'].get('code')}"] += 1
                    return
                choices = event.get("choices") or []
                if choices and _has_content(choices[0]) and first is None:
                    first = time.monotonic() - start
                chunks += 1
                if kill_after is not None and chunks > kill_after:
                    counts["client_aborted"] += 1
                    return  # leaving the block closes the connection mid-stream
                finished = finished or any(c.get("finish_reason") for c in choices)
            if first is not None:
                self.report.ttfts.append(first)
            counts["finished" if finished else "stream_ended_unfinished"] += 1

    def _count(self, status: int, finished: bool) -> None:
        counts = self.report.counts
        if status == 200:
            counts["accepted"] += 1
            counts["finished" if finished else "unfinished"] += 1
        elif status == 503:
            counts["overloaded_503"] += 1
        elif 400 <= status < 500:
            counts[f"rejected_{status}"] += 1
        else:
            counts[f"server_error_{status}"] += 1

    def _sample_tree(self, pid: int) -> None:
        by_role, sent = rss_by_role(pid), self.report.counts["sent"]
        self.report.rss_by_process_timeline.append((sent, by_role))
        self.report.rss_tree_timeline.append((sent, round(sum(rss for rss, _ in by_role.values()), 1)))

    async def run(self, pid: int) -> None:
        options, report = self.options, self.report
        started = time.monotonic()
        deadline = started + options.duration_s
        next_index = 0
        limits = httpx.Limits(max_connections=options.concurrency * 2)
        async with httpx.AsyncClient(base_url=self.url, timeout=300, limits=limits) as client:

            async def worker() -> None:
                nonlocal next_index
                while next_index < options.num_requests and time.monotonic() < deadline:
                    index, next_index = next_index, next_index + 1
                    try:
                        await self.one(client, index)
                    except httpx.HTTPError as exc:
                        report.counts[f"transport_{type(exc).__name__}"] += 1
                    report.counts["sent"] += 1
                    rss = rss_mb(pid)
                    report.rss_peak_mb = max(report.rss_peak_mb, rss)
                    warm = (report.counts["sent"] >= options.warmup_share * options.num_requests
                            or time.monotonic() - started >= options.warmup_share * options.duration_s)  # fmt: skip
                    if warm and not report.rss_warm_mb:
                        report.rss_warm_mb = rss
                    if report.counts["sent"] % options.rss_sample_every == 0:
                        report.rss_timeline.append((report.counts["sent"], round(time.monotonic() - started, 1), rss,
                                                    rss_mb(pid, "RssAnon"), rss_mb(pid, "RssFile")))  # fmt: skip
                        self._sample_tree(pid)

            await asyncio.gather(*(worker() for _ in range(options.concurrency)))


def _has_content(choice: dict) -> bool:
    return bool(choice.get("text") or (choice.get("delta") or {}).get("content"))


# ---------------------------------------------------------------------------------------------------- the soak
def run_soak(options: SoakOptions) -> SoakReport:
    report, port = SoakReport(), _free_port()
    url = f"http://127.0.0.1:{port}"
    started = time.monotonic()
    proc = start_server(options, port)
    try:
        wait_ready(proc, url)
        warm = httpx.post(url + "/v1/completions", json={"prompt": "warm up", "max_tokens": 4}, timeout=300)
        warm.raise_for_status()
        report.rss_start_mb = report.rss_peak_mb = rss_mb(proc.pid)
        for _ in range(options.rounds):
            before = rss_mb(proc.pid)
            asyncio.run(SoakClients(url, options, report).run(proc.pid))  # seeded afresh: the same requests
            _settle(url, report)
            report.rss_rounds.append((before, rss_mb(proc.pid)))
        report.rss_end_mb = rss_mb(proc.pid)
        proc.send_signal(signal.SIGTERM)
        report.exit_code = proc.wait(120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    report.wall_s = time.monotonic() - started
    report.failures = check(report, options)
    return report


def _settle(url: str, report: SoakReport, timeout_s: float = 120.0) -> None:
    """Wait until the engine holds nothing (aborts land at the next step), then read what is left."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=10) as http:  # one client for the polls (wait_ready says why)
        while True:
            metrics = parse_metrics(http.get(url + "/metrics").text)
            report.leaked_blocks = metrics.get("batchserve:kv_cache_blocks_used", -1)
            report.left_running = metrics.get("batchserve:num_requests_running", -1)
            report.left_waiting = metrics.get("batchserve:num_requests_waiting", -1)
            if (report.leaked_blocks, report.left_running, report.left_waiting) == (0, 0, 0):
                return
            if time.monotonic() > deadline:
                return
            time.sleep(0.1)  # the aborts land within a step or two: a long poll would be most of the wait


def check(report: SoakReport, options: SoakOptions) -> list[str]:
    counts, failures = report.counts, []
    if report.leaked_blocks != 0 or report.left_running != 0 or report.left_waiting != 0:
        failures.append(
            f"left behind: {report.leaked_blocks} blocks, {report.left_running} running, {report.left_waiting} waiting"
        )
    errors = {k: v for k, v in counts.items()
              if k.startswith(("server_error", "bad_answered", "transport", "hostile_answered"))}  # fmt: skip
    if errors:
        failures.append(f"server errors or broken connections: {errors}")
    unfinished = counts["unfinished"] + counts["stream_ended_unfinished"]
    unfinished += sum(v for k, v in counts.items() if k.startswith("stream_error"))
    if unfinished:
        failures.append(f"{unfinished} accepted requests neither finished nor aborted by their client")
    if counts["accepted"] != counts["finished"] + counts["client_aborted"] + unfinished:
        failures.append("accepted != finished + client-aborted + unfinished")
    if report.rss_end_mb - report.rss_warm_mb > options.max_rss_growth_mb:
        failures.append(f"RSS grew {report.rss_end_mb - report.rss_warm_mb:.0f} MB after the warm-up share of the load")
    steep = {role: slope for role, (slope, _anon) in report.rss_slopes_by_process.items()
             if options.max_slope_mb_per_1000 and slope > options.max_slope_mb_per_1000}  # fmt: skip
    if steep:
        failures.append(
            "RSS grew over the second half, MB per 1,000 requests: "
            + ", ".join(f"{role} {slope:+.2f}" for role, slope in steep.items())
            + f" (at most {options.max_slope_mb_per_1000:g})"
        )
    if report.exit_code != 0:
        failures.append(f"the server exited with {report.exit_code} on SIGTERM")
    return failures


def format_report(report: SoakReport) -> str:
    c = report.counts
    lines = [
        f"sent {c['sent']}: accepted {c['accepted']} (finished {c['finished']}, client-aborted {c['client_aborted']}), "
        f"overloaded 503 {c['overloaded_503']}, bad requests rejected {c['bad_rejected']}, "
        f"other 4xx {sum(v for k, v in c.items() if k.startswith('rejected_'))}, hostile refused "
        f"{c['hostile_refused']} (served {c['hostile_served']})",
        "hostile bodies by status: "
        + ", ".join(f"{name} {dict(statuses)}" for name, statuses in report.hostile.items()),
        f"TTFT of streams: p50 {statistics.median(report.ttfts) if report.ttfts else float('nan'):.3f} s, "
        f"p99 {report.ttft_p99_s:.3f} s",
        f"RSS: {report.rss_start_mb:.0f} MB at start, {report.rss_warm_mb:.0f} MB after the warm-up share, "
        f"{report.rss_peak_mb:.0f} MB peak, {report.rss_end_mb:.0f} MB at the end ({report.rss_end_mb - report.rss_start_mb:+.0f} "
        f"MB in all, {report.rss_end_mb - report.rss_warm_mb:+.0f} MB after the warm-up share; "
        f"{report.rss_slope_mb_per_1000:+.1f} MB per 1,000 requests over the second half; the whole process tree: "
        f"{report.rss_tree_timeline[-1][1] if report.rss_tree_timeline else float('nan'):.0f} MB last, "
        f"{report.rss_tree_slope_mb_per_1000:+.1f} MB per 1,000 requests)",
        by_process_line(report),
        "RSS growth by round (the same requests each round): "
        + ", ".join(f"{after - before:+.1f} MB" for before, after in report.rss_rounds),
        f"after the load: {report.leaked_blocks:g} KV blocks held, {report.left_running:g} running, "
        f"{report.left_waiting:g} waiting; exit code on SIGTERM {report.exit_code}; {report.wall_s:.0f} s in all",
        "PASS" if not report.failures else "FAIL: " + "; ".join(report.failures),
    ]
    return "\n".join(lines)


def by_process_line(report: SoakReport) -> str:
    """Each process of the tree: its last RSS and its slopes over the second half, the steepest first."""
    if not report.rss_by_process_timeline:
        return "RSS by process: not sampled"
    last, slopes = report.rss_by_process_timeline[-1][1], report.rss_slopes_by_process
    # a child seen only while it started (a spawned interpreter is "python" until it names itself) is left out
    slopes = {role: slope for role, slope in slopes.items() if role in last or not math.isnan(slope[0])}
    order = sorted(slopes, key=lambda role: -abs(slopes[role][0]) if not math.isnan(slopes[role][0]) else 0)
    parts = [
        f"{role} {last[role][0] if role in last else float('nan'):.0f} MB last, {slopes[role][0]:+.2f} "
        f"(anonymous {slopes[role][1]:+.2f})"
        for role in order
    ]
    return "RSS by process, MB per 1,000 requests over the second half: " + "; ".join(parts)
