import json

import pytest

from batchserve.bench import cli, offline, tune
from batchserve.config import EngineConfig


@pytest.fixture
def fake_build(monkeypatch, make_engine):
    """offline.build_engine builds the real engine over the fake runner (0.5 ms a step)."""
    built = []

    def build(config, like=None, share_runner=True):
        engine = make_engine(config, delay_s=0.0005)
        built.append(engine)
        return engine

    monkeypatch.setattr(offline, "build_engine", build)
    return built


def test_bench_compare_static_end_to_end(fake_build, tmp_path, capsys):
    rc = cli.main(
        [
            "--offline",
            "--compare-static",
            "--workload",
            "uniform",
            "--num-requests",
            "24",
            "--input-len",
            "8",
            "--output-len",
            "20",
            "--max-batch-size",
            "6",
            "--no-progress",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert "static" in out and "max_utilization" in out and "dynamic vs static" in out
    (run_dir,) = tmp_path.iterdir()
    names = {p.name for p in run_dir.iterdir()}
    for label in ("static", "max_utilization"):
        assert {
            f"trace-{label}.json",
            f"trace-{label}.perfetto.json",
            f"timeline-{label}.png",
            f"kv-{label}.png",
        } <= names
    summary = json.loads((run_dir / "summary.json").read_text())
    assert set(summary["runs"]) == {"static", "max_utilization"}
    assert summary["runs"]["static"]["batch_occupancy"] < summary["runs"]["max_utilization"]["batch_occupancy"]
    assert summary["workload"]["num_requests"] == 24
    assert [e.config.scheduler.scheduler_policy for e in fake_build] == ["static", "max_utilization"]


def test_bench_sweep_draws_the_curve(fake_build, tmp_path):
    rc = cli.main(
        [
            "--offline",
            "--workload",
            "longtail",
            "--num-requests",
            "8",
            "--input-len",
            "4",
            "--output-len",
            "5",
            "--sweep-rates",
            "200,400",
            "--no-progress",
            "--output-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    (run_dir,) = tmp_path.iterdir()
    assert (run_dir / "throughput-latency.png").stat().st_size > 1000
    runs = json.loads((run_dir / "summary.json").read_text())["runs"]
    assert set(runs) == {"max_utilization@200", "max_utilization@400"}


def test_bench_argument_errors(capsys):
    from batchserve.entrypoints.openai.launch import free_port

    port = free_port()  # no target: vLLM's default, --host:--port, where nothing listens
    assert cli.main(["--workload", "uniform", "--port", str(port), "--disable-tqdm", "--no-save-result"]) == 2
    assert f"no server answers at http://127.0.0.1:{port}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["--base-url", "http://x", "--compare-static"])


def test_tune_writes_a_loadable_config(fake_build, tmp_path, capsys):
    out = tmp_path / "tuned.json"
    rc = tune.main(
        [
            "--workload",
            "uniform",
            "--num-requests",
            "12",
            "--input-len",
            "4",
            "--output-len",
            "6",
            "--request-rate",
            "inf",
            "--batch-sizes",
            "2,8",
            "--num-tokens",
            "64,128",
            "--policies",
            "static,max_utilization",
            "--slo-ttft-ms",
            "10000",
            "--block-size",
            "32",
            "--no-progress",
            "--output",
            str(out),
            "--results-json",
            str(tmp_path / "rows.json"),
        ]
    )
    assert rc == 0
    chosen = json.loads(out.read_text())
    assert chosen["block_size"] == 32  # the user's explicit options are kept
    assert chosen["max_batch_size"] == 8  # 8 at once beats 2 at a time by far
    EngineConfig.from_options(**chosen)
    saved = json.loads((tmp_path / "rows.json").read_text())
    assert len(saved["rows"]) == 8 and saved["meets_slo"]
    assert {k: chosen[k] for k in tune.SWEPT} == saved["best"]["config"]
    assert saved["best"]["summary"]["goodput"] == max(r["summary"]["goodput"] for r in saved["rows"])
    assert "<- best" in capsys.readouterr().out


def test_pick_best_prefers_feasible():
    rows = [
        {"config": {"n": 1}, "summary": {"goodput": 5.0, "output_throughput": 10, "slo_attainment": 0.5}},
        {"config": {"n": 2}, "summary": {"goodput": 3.0, "output_throughput": 9, "slo_attainment": 0.95}},
    ]
    assert tune.pick_best(rows, 0.9) == (rows[1], True)
    assert tune.pick_best(rows, 0.99) == (rows[0], False)
    assert tune.pick_best([], 0.9) == (None, False)
