"""Soak the HTTP server (loopback only; bounded in requests and time) and check that nothing leaks or breaks.

    python benchmarks/soak.py                              # 400 requests or 2 minutes, the default model
    python benchmarks/soak.py --num-requests 10000 --duration-s 3600
    taskset -c 0 python benchmarks/soak.py --server-arg=--num-threads=1   # the soak on one core of its own

Starts `batchserve serve` in its own process with a small KV pool, drives it with streaming and non-streaming
clients (random lengths and priorities, a quarter of the streams dropped mid-way, bad requests mixed in), then checks:
0 KV blocks held, nothing left running or waiting, no 5xx but 503, every accepted request finished or aborted by its
client, RSS growth within a bound, exit 0 on SIGTERM. Prints the figures and writes them as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from batchserve.bench.soak import SoakOptions, format_report, run_soak


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for f in dataclasses.fields(SoakOptions):
        if f.name == "extra_server_args":
            continue
        kind = float if isinstance(f.default, float) else int if isinstance(f.default, int) else str
        parser.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default)
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        dest="extra_server_args",
        help="one more argument for `batchserve serve` (repeat it), e.g. --server-arg=--num-threads=1",
    )
    parser.add_argument("--output", default="bench_results/soak.json")
    args = parser.parse_args(argv)
    options = SoakOptions(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SoakOptions)})
    report = run_soak(options)
    print(format_report(report))
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps({"options": dataclasses.asdict(options), **report.as_dict()}, indent=2))
    return 0 if not report.failures else 1


if __name__ == "__main__":
    sys.exit(main())
