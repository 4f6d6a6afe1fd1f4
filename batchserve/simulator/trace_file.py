"""A workload from a trace file: one JSON object a line with `arrival_s` (seconds from the start), `output_len`, and
either `prompt_token_ids` or `input_len` (plus optional `prefix_group` and `prefix_len`: requests of one group share
their first prefix_len tokens, as a common system prompt would)."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

from batchserve.bench.workloads import BenchRequest

VOCAB = 32000  # synthetic token ids: any model's vocabulary is larger


@dataclass
class TraceArrivals:
    """Quacks like bench.arrivals.ArrivalProcess: the offsets are the file's."""

    times: list[float]
    path: str
    max_concurrency: int | None = None
    request_rate: float | None = None

    def offsets(self, n: int, seed: int = 0) -> list[float]:
        return self.times[:n]

    def describe(self) -> str:
        return f"arrivals from {self.path}"


def load_trace(path: str | Path, limit: int | None = None) -> tuple[list[BenchRequest], TraceArrivals]:
    rows = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
    rows = sorted(rows[:limit] if limit else rows, key=lambda r: float(r["arrival_s"]))
    rng, prefixes = random.Random(0), {}
    requests = []
    for i, row in enumerate(rows):
        if "prompt_token_ids" in row:
            ids = [int(t) for t in row["prompt_token_ids"]]
        else:
            n = int(row["input_len"])
            group, plen = row.get("prefix_group"), min(int(row.get("prefix_len", 0)), n)
            head = prefixes.setdefault(group, [rng.randrange(VOCAB) for _ in range(plen)]) if group is not None else []
            head = head[:plen]
            ids = head + [rng.randrange(VOCAB) for _ in range(n - len(head))]
        requests.append(
            BenchRequest(f"req-{i}", ids, max(1, int(row["output_len"])), str(row.get("category", "trace")))
        )
    if not requests:
        raise ValueError(f"{path}: no requests")
    return requests, TraceArrivals([float(r["arrival_s"]) - float(rows[0]["arrival_s"]) for r in rows], str(path))
