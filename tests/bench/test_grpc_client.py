"""The bench's gRPC backend against the live gRPC front end (model-free engine), and `batchserve bench --backend
http,grpc` putting both front ends of one server side by side in one run."""

from __future__ import annotations

import json

from batchserve.bench.arrivals import ArrivalProcess
from batchserve.bench.cli import main as bench_main
from batchserve.bench.grpc_client import run_grpc
from batchserve.bench.workloads import WorkloadOptions, make_workload
from tests.server.fakes import fake_engine
from tests.server.grpc_live import LiveGrpc
from tests.server.live import start_server


def test_run_grpc_times_every_step(tokenizer):
    http = start_server(fake_engine(delay_s=0.002))
    live = LiveGrpc(http.async_engine)
    try:
        reqs = make_workload("uniform", tokenizer, 6, options=WorkloadOptions(input_len=8, output_len=5, spread=0))
        reqs[-1].prompt_token_ids = [10_000]  # outside the vocabulary: refused, recorded, the run goes on
        trace = run_grpc(live.target, reqs, ArrivalProcess(max_concurrency=3), progress=False)
        ok, bad = trace.requests[:5], trace.requests[5]
        assert all(r.success and r.output_len == 5 and len(r.token_times) == 5 for r in ok)
        assert all(r.arrival_time <= r.first_token_time <= r.finish_time for r in ok)
        assert all(r.num_cached_tokens is not None for r in ok)
        assert not bad.success and "INVALID_ARGUMENT" in bad.error
        assert trace.meta["target"] == f"grpc://{live.target}"
    finally:
        live.stop()
        http.stop()


def test_bench_puts_http_and_grpc_side_by_side(tokenizer, tmp_path, capsys):
    tokenizer.save_pretrained(tmp_path / "tok")
    http = start_server(fake_engine(delay_s=0.002))
    live = LiveGrpc(http.async_engine)
    try:
        argv = ["--base-url", http.url, "--grpc-target", live.target, "--backend", "http,grpc",
                "--tokenizer", str(tmp_path / "tok"), "--num-requests", "6", "--input-len", "12", "--output-len", "6",
                "--spread", "0", "--max-concurrency", "3", "--output-dir", str(tmp_path / "out"), "--no-plots",
                "--no-progress"]  # fmt: skip
        assert bench_main(argv) == 0
    finally:
        live.stop()
        http.stop()
    (summary_file,) = (tmp_path / "out").glob("*/summary.json")
    runs = json.loads(summary_file.read_text())["runs"]
    assert set(runs) == {"http", "grpc"}
    for run in runs.values():
        assert run["completed"] == 6 and run["failed"] == 0 and run["total_output_tokens"] == 36
        assert run["ttft_ms"]["p50"] > 0 and run["output_throughput"] > 0
    table = capsys.readouterr().out
    assert "http" in table and "grpc" in table


def test_grpc_needs_a_target(capsys):
    assert bench_main(["--base-url", "http://x", "--backend", "grpc", "--no-progress"]) == 2
    assert "--grpc-target" in capsys.readouterr().err
    assert bench_main(["--base-url", "http://x", "--backend", "http,smoke", "--no-progress"]) == 2
