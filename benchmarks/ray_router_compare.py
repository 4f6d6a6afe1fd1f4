"""Scale-out on Ray Serve, side by side in one run: the prefix-aware router vs Ray Serve's default (power of two
choices) vs one engine with the same total threads, on a shared-prefix workload; and the cost of the Ray hop (one
replica through Ray vs the plain server, same threads, same load).

    .venv/bin/python benchmarks/ray_router_compare.py                        # 8 system prompts x 24 users
    .venv/bin/python benchmarks/ray_router_compare.py --num-requests 48 --configs prefix-aware,power-of-two

Each configuration is a fresh `batchserve serve` (so no run finds another's prompts in a cache), driven by
`batchserve bench --base-url` with the same requests (same seed) at the same Poisson rate; the table reads each
run's summary JSON. Threads: 2 replicas get 1 thread each, the single engines get 2. With --num-kv-blocks each of
the 2 replicas gets that many blocks and a single engine twice as many: the same KV memory in every configuration.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from batchserve.bench.soak import wait_ready

REPO = Path(__file__).resolve().parent.parent
CONFIGS = {  # name: (serve flags, description)
    "prefix-aware": (["--replicas", "2", "--router", "prefix-aware", "--num-threads", "1"], "Ray, 2 x 1 thread"),
    "power-of-two": (["--replicas", "2", "--router", "power-of-two", "--num-threads", "1"], "Ray, 2 x 1 thread"),
    "one-engine": (["--num-threads", "2"], "plain server, 2 threads"),
    "ray-one-replica": (["--replicas", "1", "--num-threads", "2"], "Ray, 1 x 2 threads"),
    "one-engine-1t": (["--num-threads", "1"], "plain server, 1 thread"),
    "ray-one-replica-1t": (["--replicas", "1", "--num-threads", "1"], "Ray, 1 x 1 thread"),
    "ray-one-replica-proxy": (
        ["--replicas", "1", "--num-threads", "2", "--ray-proxy"],
        "Ray, 1 x 2 threads, HTTP via Ray's proxy",
    ),
}
COLUMNS = [  # (header, summary key, format, scale)
    ("prefix hit %", "prefix_cache_hit_rate", "{:.1f}", 100),
    ("TTFT p50 ms", ("ttft_ms", "p50"), "{:.0f}", 1),
    ("TTFT p99 ms", ("ttft_ms", "p99"), "{:.0f}", 1),
    ("TPOT p50 ms", ("tpot_ms", "p50"), "{:.1f}", 1),
    ("out tok/s", "output_throughput", "{:.1f}", 1),
    ("req/s", "request_throughput", "{:.2f}", 1),
    ("failed", "failed", "{:.0f}", 1),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated, of {', '.join(CONFIGS)}")
    parser.add_argument("--num-requests", type=int, default=192)
    parser.add_argument("--num-prefixes", type=int, default=8)
    parser.add_argument("--prefix-len", type=int, default=500)
    parser.add_argument("--input-len", type=int, default=24, help="each user's question, after the system prompt")
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=4.0)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument(
        "--num-kv-blocks", type=int, default=None,
        help="KV blocks per replica (the single engines get twice as many: the same memory in all); default: each "
        "engine's own sizing. Set it below what all the system prompts take on one replica to see the router "
        "double the cache: 8 x 500 tokens = 250 blocks of 16",
    )  # fmt: skip
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--output-dir", default=str(REPO / "bench_results" / "ray_router"))
    args = parser.parse_args()

    out_dir = Path(args.output_dir) / time.strftime("%Y%m%d-%H%M%S")
    results = {}
    for name in args.configs.split(","):
        flags, what = CONFIGS[name]
        print(f"== {name} ({what})", flush=True)
        summary = run_config(name, flags, args, out_dir / name)
        results[name] = {"setup": what, "summary": summary}
    table = format_table(results)
    print(table)
    for threads, hop in _hop_costs(results).items():
        print(
            f"Ray hop, {threads} engine thread(s): one replica through Ray gives {hop:.1%} less output tok/s than the plain server"
        )
    (out_dir / "ray_router_compare.json").write_text(
        json.dumps({"args": vars(args), "machine": _machine(), "results": results, "table": table}, indent=1)
    )
    print(f"saved {out_dir / 'ray_router_compare.json'}")
    return 0


def run_config(name: str, flags: list[str], args: argparse.Namespace, out_dir: Path) -> dict:
    serve = [sys.executable, "-m", "batchserve.cli", "serve", "--port", str(args.port), "--dtype", args.dtype, *flags]
    if args.num_kv_blocks:
        replicas = int(flags[flags.index("--replicas") + 1]) if "--replicas" in flags else 0
        serve += ["--num-kv-blocks", str(args.num_kv_blocks * (1 if replicas == 2 else 2))]
    out_dir.mkdir(parents=True, exist_ok=True)
    log = out_dir.parent / f"{name}-server.log"
    routing: dict = {}
    with open(log, "w") as sink:
        server = subprocess.Popen(serve, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            wait_ready(server, f"http://127.0.0.1:{args.port}", timeout_s=600)
            bench = [
                sys.executable, "-m", "batchserve.cli", "bench", "--base-url", f"http://127.0.0.1:{args.port}",
                "--workload", "shared-prefix", "--num-prefixes", str(args.num_prefixes),
                "--prefix-len", str(args.prefix_len), "--input-len", str(args.input_len),
                "--output-len", str(args.output_len), "--ignore-eos", "--num-requests", str(args.num_requests),
                "--request-rate", str(args.request_rate), "--seed", "0", "--no-plots", "--no-progress",
                "--output-dir", str(out_dir),
            ]  # fmt: skip
            with ProcessCpu(server.pid) as cpu:
                subprocess.run(bench, cwd=REPO, check=True)
            print(f"{name}: CPU seconds by process during the load: {cpu.report()}", flush=True)
            routing = _scrape_routing(f"http://127.0.0.1:{args.port}/metrics", out_dir.parent / f"{name}-metrics.txt")
        finally:
            os.killpg(server.pid, signal.SIGINT)
            try:
                server.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
    summaries = sorted(out_dir.glob("**/summary.json"))
    if not summaries:
        raise SystemExit(f"{name}: bench wrote no summary.json under {out_dir}")
    summary = json.loads(summaries[-1].read_text())["runs"]["http"]
    if routing:
        print(f"{name}: {routing}", flush=True)
    return {**summary, "routing": routing, "cpu_s_by_process": cpu.seconds}


class ProcessCpu:
    """CPU seconds each process under the server used while the block ran (Ray's proxy, controller, GCS, raylet,
    ingress and replicas are all descendants of the `batchserve serve` process), summed by process title."""

    def __init__(self, root_pid: int) -> None:
        import psutil

        self._root = psutil.Process(root_pid)
        self.seconds: dict[str, float] = {}
        self.wall_s = 0.0

    def _sample(self) -> dict[int, tuple[str, float]]:
        import psutil

        taken = {}
        for proc in [self._root, *self._root.children(recursive=True)]:
            try:
                times = proc.cpu_times()
                title = " ".join(proc.cmdline()[:1]) or proc.name()
                taken[proc.pid] = (title.split("/")[-1][:60], times.user + times.system)
            except psutil.Error:
                continue
        return taken

    def __enter__(self) -> ProcessCpu:
        self._start, self._t0 = self._sample(), time.monotonic()
        return self

    def __exit__(self, *exc: object) -> None:
        end, self.wall_s = self._sample(), time.monotonic() - self._t0
        for pid, (title, cpu) in end.items():
            used = cpu - self._start.get(pid, (title, 0.0))[1]
            if used > 0.05:
                self.seconds[title] = round(self.seconds.get(title, 0.0) + used, 2)

    def report(self) -> str:
        ranked = sorted(self.seconds.items(), key=lambda kv: -kv[1])
        return f"over {self.wall_s:.0f} s: " + ", ".join(f"{t} {s:.1f}" for t, s in ranked)


def _scrape_routing(url: str, save_to: Path) -> dict:
    """From the server's /metrics (saved whole): the router's decisions, per replica its prompt tokens and
    prefix-cache hits, and the engines' step time by phase (the warm-up's requests included)."""
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            text = response.read().decode()
    except OSError as exc:
        return {"error": str(exc)}
    save_to.write_text(text)
    routing: dict = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            replica = sample.labels.get("replica", "")
            if sample.name == "batchserve:router_decisions_total":
                routing.setdefault("decisions", {})[sample.labels["decision"]] = sample.value
            elif sample.name == "batchserve:step_phase_seconds_total":  # every replica's engine steps, summed
                phases = routing.setdefault("step_phase_s", {})
                phases[sample.labels["phase"]] = round(phases.get(sample.labels["phase"], 0.0) + sample.value, 2)
            elif sample.name in ("batchserve:prefix_cache_hits_total", "batchserve:prompt_tokens_total") and replica:
                routing.setdefault("replicas", {}).setdefault(replica, {})[sample.name.split(":")[1]] = sample.value
    return routing


def _get(summary: dict, key: str | tuple[str, str]) -> float | None:
    value = summary.get(key[0], {}).get(key[1]) if isinstance(key, tuple) else summary.get(key)
    return value if isinstance(value, int | float) else None


def format_table(results: dict) -> str:
    header = ["config", "setup"] + [c[0] for c in COLUMNS]
    rows = [header]
    for name, result in results.items():
        cells = [name, result["setup"]]
        for _, key, fmt, scale in COLUMNS:
            value = _get(result["summary"], key)
            cells.append("-" if value is None else fmt.format(value * scale))
        rows.append(cells)
    widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |" for r in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def _hop_costs(results: dict) -> dict[str, float]:
    """{threads: 1 - Ray's output tok/s / the plain server's}, for each pair of one replica and one engine run."""
    costs = {}
    for ray_name, plain_name, threads in (
        ("ray-one-replica", "one-engine", "2"),
        ("ray-one-replica-1t", "one-engine-1t", "1"),
    ):
        if ray_name in results and plain_name in results:
            ray_tps = _get(results[ray_name]["summary"], "output_throughput")
            plain_tps = _get(results[plain_name]["summary"], "output_throughput")
            if ray_tps and plain_tps:
                costs[threads] = 1 - ray_tps / plain_tps
    return costs


def _machine() -> dict:
    from batchserve.bench.machine import machine_info

    return machine_info()


if __name__ == "__main__":
    sys.exit(main())
