"""--compare-static's estimate before it starts, and its warning when same-shape steps varied more than the ratio it
reports."""

from __future__ import annotations

import pytest

from batchserve.bench import cli, offline
from batchserve.bench.compare_checks import estimate_line, estimate_steps, noise_warning, step_noise
from batchserve.bench.metrics import StepSample
from batchserve.bench.trace import RunTrace
from batchserve.bench.workloads import BenchRequest


def request(i: int, prompt_len: int, output_len: int) -> BenchRequest:
    return BenchRequest(f"r{i}", list(range(prompt_len)), output_len)


def test_estimate_steps_from_the_workload():
    requests = [request(0, 10, 5), request(1, 30, 9), request(2, 50, 2)]
    # static, batches of 2: [r0 r1]: ceil(40 / 32) + 9 = 11; [r2]: ceil(50 / 32) + 2 = 4
    # continuous: ceil(90 / 32) prefill + max(ceil(16 / 2), 9) decode = 3 + 9
    assert estimate_steps(requests, max_batch_size=2, max_num_tokens=32) == (15, 12)
    line = estimate_line((15, 12), 0.02, runs=2)
    assert "at least 30 static + 24 continuous steps" in line and "about 1 s" in line and "20 ms" in line


def steps(times: list[float], seqs: int = 4) -> list[StepSample]:
    out, t = [], 0.0
    for duration in times:
        out.append(StepSample(start=t, end=t + duration, num_scheduled_seqs=seqs, num_decode_tokens=seqs))
        t += duration
    return out


def trace(times: list[float]) -> RunTrace:
    return RunTrace("run", 0.0, 4, steps(times), [], {})


def test_step_noise_is_the_spread_of_same_shape_steps():
    assert step_noise(steps([0.02] * 20)) == pytest.approx(0.0)
    assert step_noise(steps([0.02] * 10 + [0.04] * 10)) == pytest.approx(1.0)
    assert step_noise(steps([0.02] * 5)) is None  # too few to say
    prefill = [StepSample(start=0, end=1, num_scheduled_seqs=4, num_prefill_tokens=100)] * 30
    assert step_noise(prefill + steps([0.02] * 12)) == pytest.approx(0.0)  # prefill steps are another shape


def test_a_warning_when_the_host_varied_more_than_the_ratio():
    quiet, busy = trace([0.02] * 20), trace([0.02] * 10 + [0.03] * 10)  # 50% spread
    assert noise_warning(quiet, quiet, 1.15) is None
    assert noise_warning(quiet, busy, 1.60) is None  # the effect is larger than the noise
    warning = noise_warning(quiet, busy, 1.15)
    assert warning is not None and "50%" in warning and "15.0%" in warning


def test_compare_static_prints_its_estimate_before_it_runs(monkeypatch, make_engine, tmp_path, capsys):
    monkeypatch.setattr(offline, "build_engine", lambda config, like=None, share_runner=True: make_engine(config))
    rc = cli.main(["--offline", "--compare-static", "--num-requests", "8", "--input-len", "4", "--output-len", "4",
                   "--spread", "0", "--max-batch-size", "4", "--no-progress", "--no-save-result"])  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    # static: 2 batches x (1 prefill step + 4 decode steps); continuous: 1 prefill step + max(8, 4) decode steps
    assert "estimate: at least 10 static + 9 continuous steps, about" in out
    assert out.index("estimate:") < out.index("dynamic vs static")


def test_the_estimate_is_timed_by_the_warm_ups_decode_steps():
    import time

    from batchserve.bench.warmup import report_of

    prefill = [StepSample(start=0.0, end=0.9, num_scheduled_seqs=4, num_prefill_tokens=400)] * 3
    report = report_of(RunTrace("warmup", 0.0, 4, prefill + steps([0.02] * 2), []), time.monotonic())
    assert report.typical_s == pytest.approx(0.9) and report.decode_step_s == pytest.approx(0.02)
