"""`batchserve doctor` end to end: --url of a live server (the fake engine) and a bench trace file."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import httpx

from batchserve.bench.metrics import RequestResult, StepSample
from batchserve.bench.trace import RunTrace
from batchserve.cli import main as batchserve_main
from tests.server.fakes import fake_engine
from tests.server.live import start_server


def test_doctor_watches_a_live_server_behind_its_key(capsys):
    server = start_server(fake_engine(delay_s=0.004, max_batch_size=2, max_num_tokens=256), api_key="k")
    auth = {"Authorization": "Bearer k"}

    def one(i: int) -> None:
        body = {"prompt": "w" * (12 + i % 7), "max_tokens": 8, "ignore_eos": True}
        httpx.post(server.url + "/v1/completions", json=body, headers=auth, timeout=60)

    pool = ThreadPoolExecutor(12)
    try:
        futures = [pool.submit(one, i) for i in range(150)]
        code = batchserve_main(["doctor", "--url", server.url, "--api-key", "k", "--window", "1.5", "--json"])
        for future in futures:
            future.cancel()  # the rest of the load is not needed
        pool.shutdown(wait=True)
    finally:
        server.stop()
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    finding = next(f for f in report["findings"] if f["rule"] == "queue_backed_up")
    assert "max_batch_size 2 -> 4" in finding["change"] and "predicted" in finding["prediction"]["text"]


def _trace(path, waiting: int) -> None:
    """A bench trace of 40 requests and 100 steps, requests waiting at `waiting` in every step."""
    steps = [StepSample(i * 0.01, i * 0.01 + 0.009, num_scheduled_seqs=4, max_batch_size=4, num_waiting=waiting,
                        num_running=4, num_decode_tokens=4, kv_blocks_total=64, kv_blocks_used=10)
             for i in range(100)]  # fmt: skip
    requests = [RequestResult(f"r{i}", 16, 8, i * 0.025, i * 0.025 + 0.02, i * 0.025 + 0.1) for i in range(40)]
    RunTrace("t", 0.0, 4, steps, requests, {"duration_s": 1.0}).save_json(path)


def test_doctor_reads_a_bench_trace(tmp_path, capsys):
    _trace(tmp_path / "busy.json", waiting=6)
    _trace(tmp_path / "calm.json", waiting=0)
    args = ["--set", "max_num_tokens=512", "--set", "block_size=16", "--no-simulate"]
    assert batchserve_main(["doctor", str(tmp_path / "busy.json"), *args]) == 0
    busy = capsys.readouterr().out
    assert (
        "[queue_backed_up]" in busy and "max_batch_size 4 -> 8" in busy and "evidence: requests waited in 100%" in busy
    )
    assert batchserve_main(["doctor", str(tmp_path / "calm.json"), *args]) == 0
    assert "no problem found" in capsys.readouterr().out


def test_doctor_says_what_it_cannot_read(tmp_path, capsys):
    (tmp_path / "bad.json").write_text("{}")
    assert batchserve_main(["doctor", str(tmp_path / "bad.json")]) == 1
    assert "cannot read the bench trace" in capsys.readouterr().err
    assert batchserve_main(["doctor", "--url", "http://127.0.0.1:9", "--window", "0"]) == 1
    assert "cannot read http://127.0.0.1:9/dashboard/data" in capsys.readouterr().err
