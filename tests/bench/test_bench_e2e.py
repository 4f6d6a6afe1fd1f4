"""One small end-to-end bench on the real engine (SmolLM2): static vs dynamic, trace and pictures."""

import json

import pytest

from batchserve.bench import cli


@pytest.mark.slow
def test_compare_static_on_the_real_engine(tmp_path):
    rc = cli.main(
        ["--offline", "--compare-static", "--workload", "uniform", "--num-requests", "6", "--input-len", "16",
         "--output-len", "5", "--max-batch-size", "2", "--num-kv-blocks", "64", "--warmup-requests", "0",
         "--no-progress", "--output-dir", str(tmp_path)]
    )  # fmt: skip
    assert rc == 0
    (run_dir,) = tmp_path.iterdir()
    runs = json.loads((run_dir / "summary.json").read_text())["runs"]
    for label in ("static", "max_utilization"):
        s = runs[label]
        assert s["completed"] == 6 and s["failed"] == 0
        trace = json.loads((run_dir / f"trace-{label}.json").read_text())
        assert all(4 <= r["output_len"] <= 6 for r in trace["requests"])  # ignore_eos: 5 +- 20%, exactly
        assert s["total_output_tokens"] == sum(r["output_len"] for r in trace["requests"])
        assert 0 < s["batch_occupancy"] <= 1
        assert (run_dir / f"timeline-{label}.png").stat().st_size > 1000
    assert runs["static"]["num_steps"] >= runs["max_utilization"]["num_steps"]
