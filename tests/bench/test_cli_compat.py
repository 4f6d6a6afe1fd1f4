"""`bench` as a vLLM user runs it: vLLM's flag names, a warm-up shaped like the workload and stated, HTTP runs
with pictures and without a log line per request, one progress bar, SLOs only when asked, and what finished written
when the run is interrupted."""

from __future__ import annotations

import json
import logging
import os
import signal

import pytest

from batchserve.bench import cli, offline
from batchserve.bench.partial import ResultLog
from batchserve.bench.trace import RunTrace
from tests.server.fakes import fake_engine
from tests.server.live import start_server


@pytest.fixture
def fake_build(monkeypatch, make_engine):
    built = []

    def build(config, like=None, share_runner=True):
        built.append(make_engine(config, delay_s=0.002))
        return built[-1]

    monkeypatch.setattr(offline, "build_engine", build)
    return built


def _run_dir(tmp_path):
    (run_dir,) = tmp_path.iterdir()
    return run_dir


def test_vllm_flag_names_are_ours():
    args = cli.build_parser().parse_args(
        ["--base-url", "http://x", "--num-prompts", "7", "--dataset-name", "random", "--random-input-len", "9",
         "--random-output-len", "3", "--no-ignore-eos", "--result-dir", "d", "--no-save-result",
         "--percentile-metrics", "ttft,e2el", "--max-num-seqs", "5"]
    )  # fmt: skip
    cli.normalize(args)
    assert (args.workload, args.spread, args.num_requests, args.input_len, args.output_len) == ("uniform", 0, 7, 9, 3)
    assert args.output_dir == "d" and not args.save_result and not args.ignore_eos and args.max_batch_size == 5
    assert cli.percentile_metrics(args) == ("ttft", "e2el")
    args.percentile_metrics = "ttft,latency"
    with pytest.raises(ValueError, match="--percentile-metrics takes ttft,tpot,itl,e2el, not latency"):
        cli.normalize(args)


def test_http_run_draws_pictures_states_the_warm_up_and_logs_no_line_per_request(
    monkeypatch, tokenizer, tmp_path, capsys, caplog
):
    server = start_server(fake_engine(delay_s=0.002), served_model_name="fake")
    monkeypatch.setattr(cli, "_http_tokenizer", lambda args: tokenizer)
    try:
        with caplog.at_level(logging.INFO):
            rc = cli.main(["--base-url", server.url, "--num-prompts", "6", "--dataset-name", "random",
                           "--random-input-len", "8", "--random-output-len", "5", "--no-progress",
                           "--result-dir", str(tmp_path), "--percentile-metrics", "ttft,tpot",
                           "--num-warmups", "6"])  # fmt: skip
    finally:
        server.stop()
    assert rc == 0
    assert not [r for r in caplog.records if r.name.startswith("httpx")], "a log line per request"
    out = capsys.readouterr().out
    assert "warm-up (not timed): 6 requests shaped like the workload" in out
    assert "TTFT p50" in out and "TPOT p50" in out and "ITL p50" not in out and "E2E latency p50" not in out
    assert "SLO" not in out and "Goodput" not in out  # no SLO was asked for
    run_dir = _run_dir(tmp_path)
    for name in ("latency-cdf.png", "throughput-http.png"):
        assert (run_dir / name).stat().st_size > 5000, name
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["runs"]["http"]["completed"] == 6 and "goodput" not in summary["runs"]["http"]
    assert summary["warmup"] and not summary["interrupted"]
    lines = (run_dir / "requests.jsonl").read_text().splitlines()
    assert len(lines) == 6 and {json.loads(line)["run"] for line in lines} == {"http"}  # the warm-up's not among them


def test_offline_warm_up_fills_a_batch_and_an_asked_slo_is_printed(fake_build, tmp_path, capsys):
    rc = cli.main(["--offline", "--num-requests", "6", "--input-len", "5", "--output-len", "4", "--max-batch-size",
                   "3", "--no-progress", "--output-dir", str(tmp_path), "--slo-ttft-ms", "1000"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "warm-up (not timed): 3 requests shaped like the workload" in out  # max_batch_size of them
    assert "SLO: TTFT <= 1000 ms and TPOT <= inf ms" in out
    summary = json.loads((_run_dir(tmp_path) / "summary.json").read_text())
    assert summary["runs"]["max_utilization"]["slo_attainment"] == 1.0


def test_compare_static_draws_one_progress_bar(fake_build, tmp_path, capsys):
    rc = cli.main(["--offline", "--compare-static", "--num-requests", "8", "--input-len", "4", "--output-len", "4",
                   "--max-batch-size", "4", "--output-dir", str(tmp_path), "--warmup-requests", "0"])  # fmt: skip
    assert rc == 0
    err = capsys.readouterr().err
    assert "static+max_utilization:" in err
    assert err.count("max_utilization:") == err.count("static+max_utilization:"), "a bar per run"


def test_an_interrupted_run_writes_what_finished(fake_build, tmp_path, capsys, monkeypatch):
    add = ResultLog.add

    def add_then_sigterm(self, label, result):
        add(self, label, result)
        if sum(map(len, self.results.values())) == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # as `kill` would: the handler interrupts the run

    monkeypatch.setattr(ResultLog, "add", add_then_sigterm)
    before = signal.getsignal(signal.SIGTERM)  # SIG_DFL, or what an earlier test of this process left (ray.init's)
    rc = cli.main(["--offline", "--num-requests", "40", "--input-len", "4", "--output-len", "6", "--max-batch-size",
                   "2", "--no-progress", "--output-dir", str(tmp_path), "--warmup-requests", "0"])  # fmt: skip
    assert rc == 130
    assert "INTERRUPTED" in capsys.readouterr().out
    run_dir = _run_dir(tmp_path)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["interrupted"] and 5 <= summary["runs"]["max_utilization"]["completed"] < 40
    assert len((run_dir / "requests.jsonl").read_text().splitlines()) == summary["runs"]["max_utilization"]["completed"]
    assert signal.getsignal(signal.SIGTERM) is before  # the handler is put back


def test_an_interrupted_lockstep_run_keeps_its_own_clock(fake_build, tmp_path, monkeypatch):
    """--compare-static runs each policy on a busy clock of its own: the cut-short traces must be timed on it, or
    every token falls outside the throughput chart's axis (an empty PNG)."""
    add = ResultLog.add

    def add_then_sigterm(self, label, result):
        add(self, label, result)
        if sum(map(len, self.results.values())) == 6:
            os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(ResultLog, "add", add_then_sigterm)
    rc = cli.main(["--offline", "--compare-static", "--num-requests", "40", "--input-len", "4", "--output-len", "6",
                   "--max-batch-size", "2", "--no-progress", "--output-dir", str(tmp_path),
                   "--warmup-requests", "0"])  # fmt: skip
    assert rc == 130
    run_dir = _run_dir(tmp_path)
    traces = [RunTrace.load_json(p) for p in run_dir.glob("trace-*.json") if "perfetto" not in p.name]
    assert traces and any(t.requests for t in traces)
    for trace in traces:
        duration = trace.meta["duration_s"]
        stamps = [t - trace.t0 for r in trace.requests for t in r.token_times]
        assert stamps and all(0 <= s <= duration + 1e-6 for s in stamps), (trace.label, duration, stamps[:3])
    assert list(run_dir.glob("throughput-*.png"))
