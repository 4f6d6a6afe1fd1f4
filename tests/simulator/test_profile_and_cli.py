"""The linear step-time fit, the profile file, and `batchserve simulate` end to end (bench's table and summary.json)."""

from __future__ import annotations

import json
import random

import pytest

from batchserve.simulator.analytic import analytic_profile
from batchserve.simulator.profile_file import Profile
from batchserve.simulator.shape import FEATURES, StepShape
from batchserve.simulator.step_model import KNOTS, LinearStepModel, fit_linear
from tests.simulator.helpers import STEP_MODEL


def test_fit_recovers_known_coefficients_and_reports_held_out_error():
    rng = random.Random(0)
    truth = LinearStepModel({**STEP_MODEL.coefficients, "prefill_seqs": 2e-3, "mixed": 3e-3, "decode_ctx_distinct": 5e-7,
                             "multi_row": 4e-3})  # fmt: skip
    shapes, seconds = [], []
    for i in range(400):
        # some one-row steps; every eighth a prefill-only one (if it has a chunk)
        seqs = (1 if i % 7 == 1 else rng.randint(2, 64)) if i % 8 else 0
        prefill = rng.choice([0, 0, rng.randint(16, 2048)]) if seqs else rng.randint(16, 2048)
        chunks = rng.randint(1, 3) if prefill else 0
        ctx = rng.randint(seqs, 16 * 1024) if seqs else 0
        distinct = rng.randint(seqs, ctx) if seqs else 0  # behind shared blocks, some of them
        s = StepShape(tokens=seqs + prefill, seqs=seqs + chunks, samples=rng.randint(0, seqs), decode_ctx=ctx,
                      prefill_pairs=prefill * prefill // 2, prefill_seqs=chunks, decode_ctx_distinct=distinct)  # fmt: skip
        shapes.append(s)
        seconds.append(truth.predict(s) * rng.uniform(0.98, 1.02))
    model, report = fit_linear(shapes, seconds, knots=())  # the plain linear model: tests/simulator/test_step_model.py
    for name in FEATURES:
        assert model.coefficients[name] == pytest.approx(truth.coefficients[name], rel=0.1), name
    assert report.mape < 0.02 and abs(report.total_error) < 0.01 and report.r2 > 0.99
    assert report.num_steps == 400


def test_fit_never_goes_negative():
    # time independent of seqs, with noise that would pull a free coefficient below zero
    shapes = [StepShape(tokens=t, seqs=s) for t in range(1, 40) for s in (1, 2, 3)]
    seconds = [1e-3 + 1e-4 * sh.tokens - (1e-6 if sh.seqs == 3 else 0) for sh in shapes]
    model, _ = fit_linear(shapes, seconds)
    assert all(v >= 0 for v in model.coefficients.values()) and len(model.coefficients) == len(FEATURES) + 4


def test_profile_file_round_trip(tmp_path):
    measured = Profile("measured", LinearStepModel(dict(STEP_MODEL.coefficients)), "SmolLM2", "float32", 46080,
                       2**30, 8192, 4 * 2**30, {"cpu": "x"}, {"mape": 0.05})  # fmt: skip
    for profile in (measured, analytic_profile("llama-3-8b", "h100-sxm")):
        back = Profile.load(profile.save(tmp_path / f"{profile.source}.json"))
        assert back.to_dict() == profile.to_dict()
        shape = StepShape(tokens=70, seqs=8, samples=8, decode_ctx=4000, prefill_pairs=2000)
        assert back.step_model.predict(shape) == profile.step_model.predict(shape) > 0
    # an H100 holds (85.9 GB - 16.06 GB of weights) x 0.9 = 62.9 GB of bf16 K/V at 128 KiB a token: 479.6 k tokens
    p = analytic_profile("llama-3-8b", "h100-sxm")
    assert p.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2
    assert 479_000 < p.num_kv_blocks(16) * 16 < 480_000
    assert p.num_kv_blocks(16, fraction=0.45) == pytest.approx(p.num_kv_blocks(16) / 2, rel=0.01)
    with pytest.raises(ValueError, match="not a step profile"):
        Profile.from_dict({"format": "other"})


def test_simulate_cli_prints_benchs_table_and_writes_its_summary(tmp_path, tokenizer, capsys):
    from batchserve.simulator.cli import main

    tokenizer.save_pretrained(tmp_path / "tok")
    profile = Profile("measured", STEP_MODEL, "tiny", "float32", 1024, 1024 * 16 * 512, 4096)
    profile.save(tmp_path / "p.json")
    argv = ["--profile", str(tmp_path / "p.json"), "--tokenizer", str(tmp_path / "tok"), "--workload", "longtail",
            "--num-requests", "60", "--request-rate", "50", "--max-batch-size", "8", "--output-dir",
            str(tmp_path / "out"), "--no-plots", "--slo-ttft-ms", "200", "--slo-tpot-ms", "50", "--seed", "1"]  # fmt: skip
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "TTFT" in text and "max_utilization" in text and "simulated in" in text
    (summary_path,) = (tmp_path / "out").glob("longtail-sim-*/summary.json")
    doc = json.loads(summary_path.read_text())
    assert set(doc) == {"workload", "args", "interrupted", "warmup", "runs"}
    run = doc["runs"]["max_utilization"]
    assert run["completed"] == 60 and run["num_requests"] == 60
    for key in ("output_throughput", "ttft_ms", "tpot_ms", "itl_ms", "e2e_ms", "goodput", "batch_occupancy",
                "kv_usage_max", "num_preemptions", "mean_step_ms"):  # fmt: skip
        assert key in run, key
    assert 0 < run["slo_attainment"] <= 1 and run["batch_occupancy"] > 0
    assert (summary_path.parent / "trace-max_utilization.json").is_file()


def test_simulate_cli_many_replicas_on_a_gpu_estimate(tmp_path, tokenizer, capsys):
    from batchserve.simulator.cli import main

    tokenizer.save_pretrained(tmp_path / "tok")
    argv = ["--device-preset", "h100-sxm", "--model-shapes", "llama-3-8b", "--tokenizer", str(tmp_path / "tok"),
            "--workload", "shared-prefix", "--num-requests", "200", "--request-rate", "100", "--replicas", "4",
            "--router", "prefix-aware", "--no-save-result"]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "ESTIMATE" in out and "requests per replica" in out


def test_profiler_grid_times_the_shapes_it_promises(make_engine):
    """run_grid over the real engine (FakeRunner): prefills of each size, decodes of each batch size at growing
    contexts, and mixed steps, each recorded with its shape and a positive time."""
    from batchserve.simulator.profiler import DECODE_TOKENS, run_grid

    engine = make_engine(max_batch_size=8, num_kv_blocks=512, max_model_len=512)
    t = run_grid(engine, [(1, 32), (8, 40)], progress=False)
    assert len(t.shapes) == len(t.seconds) and all(s > 0 for s in t.seconds)
    decodes = [s for s in t.shapes if s.prefill_pairs == 0]
    assert {s.seqs for s in decodes} >= {1, 8}
    # a batch of 8 prompts of 40 decoding its k-th token reads 8 x (40 + k) positions
    eight = sorted(s.decode_ctx for s in decodes if s.seqs == 8 and s.decode_ctx < 8 * 60)
    assert eight[: DECODE_TOKENS - 1] == [8 * (40 + k) for k in range(1, DECODE_TOKENS)]
    assert any(s.prefill_pairs and s.decode_ctx for s in t.shapes)  # mixed: a prompt beside decodes
    assert not engine.has_unfinished_requests()


def test_profiler_times_on_the_clock_it_is_given(make_engine):
    """--cpu-clock's path: every step is timed on the clock run_grid gets (here one that ticks 0.25 s a reading)."""
    import itertools

    from batchserve.simulator.profiler import run_grid

    ticks = itertools.count()
    engine = make_engine(max_batch_size=8, num_kv_blocks=512, max_model_len=512)
    t = run_grid(engine, [(2, 32)], progress=False, mixed=False, clock=lambda: 0.25 * next(ticks))
    assert t.seconds and all(s == 0.25 for s in t.seconds)


def test_profiler_cpu_clock_needs_one_thread(capsys):
    from batchserve.simulator.profiler import main

    assert main(["--cpu-clock", "--num-threads", "2", "--num-kv-blocks", "16"]) == 2
    assert "--cpu-clock needs --num-threads 1" in capsys.readouterr().err


def test_dispatcher_knows_the_new_commands(capsys):
    from batchserve.cli import main

    assert main(["simulat"]) == 2
    assert "did you mean 'simulate'" in capsys.readouterr().err


def test_tune_simulate_searches_the_knobs_and_writes_the_best(tmp_path, tokenizer, capsys):
    """A load one or two replicas cannot serve within the SLO (simulated: 11% and 33% attainment at best): the
    search must pick 4 replicas, the fewest that meet it, with the batch size that does."""
    from batchserve.cli import main

    tokenizer.save_pretrained(tmp_path / "tok")
    Profile("measured", STEP_MODEL, "tiny", "float32", 1024, 1024 * 16 * 512, 4096).save(tmp_path / "p.json")
    out = tmp_path / "best.json"
    argv = ["--simulate", "--profile", str(tmp_path / "p.json"), "--tokenizer", str(tmp_path / "tok"),
            "--workload", "uniform", "--num-requests", "150", "--request-rate", "60", "--batch-sizes", "4,16",
            "--num-tokens", "256", "--policies", "max_utilization", "--replicas-list", "1,2,4",
            "--slo-ttft-ms", "300", "--slo-tpot-ms", "40", "--output", str(out), "--results-json",
            str(tmp_path / "rows.json")]  # fmt: skip
    assert main(["tune", *argv]) == 0  # the CLI sends --simulate to the simulator
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert len(rows) == 6
    fewer = [r for r in rows if r["config"]["replicas"] < 4]
    assert len(fewer) == 4 and all(r["summary"]["slo_attainment"] < 0.9 for r in fewer)  # they cannot keep up
    best = rows[0]
    assert best["config"]["replicas"] == 4 and best["config"]["max_batch_size"] == 16
    assert best["summary"]["slo_attainment"] >= 0.9 and rows[1]["summary"]["slo_attainment"] < 0.9
    written = json.loads(out.read_text())
    assert written["max_batch_size"] == best["config"]["max_batch_size"] and "replicas" not in written
    assert "configurations simulated in" in capsys.readouterr().out


def test_error_report_splits_decode_prefill_and_mixed_and_decodes_by_batch_size():
    import numpy as np

    from batchserve.simulator.step_model import error_report

    shapes = [StepShape(tokens=4, seqs=4, decode_ctx=40), StepShape(tokens=1, seqs=1, decode_ctx=9),
              StepShape(tokens=9, seqs=1, prefill_pairs=45), StepShape(tokens=10, seqs=2, decode_ctx=5, prefill_pairs=45)]  # fmt: skip
    report = error_report(shapes, np.array([0.010, 0.012, 0.010, 0.010]), np.array([0.010, 0.010, 0.020, 0.030]))
    assert list(report.by_kind) == ["decode", "prefill", "mixed"]
    assert report.by_kind["decode"] == {"steps": 2, "mape": pytest.approx(0.1), "bias": pytest.approx(0.1)}
    assert report.by_kind["prefill"]["bias"] == pytest.approx(-0.5)
    assert report.by_kind["mixed"]["mape"] == pytest.approx(2 / 3)
    assert report.decode_by_seqs == {"1": {"steps": 1, "mape": pytest.approx(0.2), "bias": pytest.approx(0.2)},
                                     "3-4": {"steps": 1, "mape": 0.0, "bias": 0.0}}  # fmt: skip


def test_fit_ignores_one_off_stalls_but_reports_them():
    rng = random.Random(1)
    shapes = [StepShape(tokens=(n := rng.randint(1, 512)), seqs=rng.randint(1, 32), samples=rng.randint(1, 8),
                        decode_ctx=rng.randint(0, 8000), prefill_pairs=n * n // 2) for _ in range(300)]  # fmt: skip
    seconds = [STEP_MODEL.predict(s) * (4.0 if i % 29 == 0 else 1.0) for i, s in enumerate(shapes)]  # ~3% stalls
    model, report = fit_linear(shapes, seconds)
    for name in ("steps", "tokens", "decode_ctx"):
        assert model.coefficients[name] == pytest.approx(STEP_MODEL.coefficients[name], rel=0.05), name
    assert report.p90_ape < 0.01 < report.mape  # the held-out stalls show in the mean, not in the p90


def test_pool_sizes_follow_the_engines_rules():
    from batchserve.config import EngineConfig
    from batchserve.simulator.build import make_engine, pool_sizes

    p = Profile(
        "measured", STEP_MODEL, "m", "bfloat16", 1000, 1000 * 16 * 300, 4096, memory_free_bytes=1000 * 16 * 4000
    )
    assert pool_sizes(EngineConfig.from_options(), p) == (300, 0)  # the profile's default pool, no swap
    assert pool_sizes(EngineConfig.from_options(block_size=32), p) == (150, 0)  # same bytes, bigger blocks
    assert pool_sizes(EngineConfig.from_options(kv_cache_memory_fraction=0.5), p) == (2000, 0)
    assert pool_sizes(EngineConfig.from_options(num_kv_blocks=77, num_swap_blocks=5), p) == (77, 5)
    swap = EngineConfig.from_options(preemption_mode="swap", swap_space_gb=0.001)
    assert pool_sizes(swap, p)[1] == int(0.001 * 1024**3) // (1000 * 16)
    engine = make_engine(EngineConfig.from_options(max_model_len=2048), p)
    assert engine.max_model_len == 2048 and engine.runner.num_kv_blocks == 300
    assert make_engine(EngineConfig.from_options(num_kv_blocks=10), p).max_model_len == 160  # the pool bounds it


def test_refit_from_the_steps_a_profile_recorded(tmp_path, capsys):
    from batchserve.simulator.profiler import main

    rng = random.Random(2)
    shapes = [StepShape(tokens=rng.randint(1, 600), seqs=rng.randint(1, 32), samples=rng.randint(1, 8),
                        decode_ctx=rng.randint(0, 9000), prefill_pairs=rng.randint(0, 90000)) for _ in range(100)]  # fmt: skip
    rows = [[*s.to_dict().values(), STEP_MODEL.predict(s)] for s in shapes]
    notes = {"step_fields": [*StepShape().to_dict(), "seconds"], "steps": rows}
    Profile("measured", LinearStepModel({"steps": 1.0}), "m", "float32", 1, 1, 8, notes=notes).save(tmp_path / "a.json")
    assert main(["--refit", str(tmp_path / "a.json"), "--output", str(tmp_path / "b.json")]) == 0
    refitted = Profile.load(tmp_path / "b.json")
    assert refitted.step_model.knots == KNOTS
    for s in shapes:  # the knots' terms are free to take part of the constant: compare times, not coefficients
        assert refitted.step_model.predict(s) == pytest.approx(STEP_MODEL.predict(s), rel=1e-6)
    assert refitted.fit["mape"] < 1e-3 and refitted.fit["num_steps"] == 100
    assert sum(e["steps"] for e in refitted.fit["by_kind"].values()) == 100
    assert "held-out error" in capsys.readouterr().out
    assert main(["--refit", str(tmp_path / "a.json"), "--output", str(tmp_path / "c.json"), "--knots", ""]) == 0
    plain = Profile.load(tmp_path / "c.json").step_model
    assert plain.knots == ()
    assert plain.coefficients["tokens"] == pytest.approx(STEP_MODEL.coefficients["tokens"], rel=1e-3)


def test_refit_with_a_runs_steps_prices_the_shapes_the_grid_never_reached(tmp_path):
    """A grid of decodes and of lone prefills says nothing of a prefill chunk beside decodes (its `mixed` cost: both
    attention paths in every layer); a run's steps, on its clock (the CPU time of a --cpu-clock run), do."""
    from batchserve.simulator.profiler import main

    truth = LinearStepModel({**STEP_MODEL.coefficients, "mixed": 0.03, "prefill_seqs": 1e-3})
    rng = random.Random(3)
    decodes = [StepShape(tokens=n, seqs=n, samples=n, decode_ctx=rng.randint(n, 9000)) for n in
               (rng.randint(1, 32) for _ in range(60))]  # fmt: skip
    prefills = [StepShape(tokens=n, seqs=1, samples=1, prefill_pairs=n * (n + 1) // 2, prefill_seqs=1) for n in
                (rng.randint(16, 2048) for _ in range(30))]  # fmt: skip
    rows = [[*s.to_dict().values(), truth.predict(s)] for s in decodes + prefills]
    notes = {"step_fields": [*StepShape().to_dict(), "seconds"], "steps": rows}
    Profile("measured", truth, "m", "float32", 1, 1, 8, notes=notes).save(tmp_path / "grid.json")
    mixed = [StepShape(tokens=n + 128, seqs=n + 1, samples=n, decode_ctx=rng.randint(n, 9000), prefill_seqs=1,
                       prefill_pairs=128 * c + 128 * 129 // 2) for n, c in
             ((rng.randint(1, 32), rng.randint(0, 1900)) for _ in range(40))]  # fmt: skip
    run = {"cpu_clock": True, "steps": {"slo": [s.to_dict() | {"cpu_s": truth.predict(s), "wall_s": 9.9}
                                                for s in mixed]}}  # fmt: skip
    (tmp_path / "run.json").write_text(json.dumps(run))
    for extra, name in (([], "alone.json"), (["--with-run", str(tmp_path / "run.json")], "both.json")):
        assert main(["--refit", str(tmp_path / "grid.json"), "--output", str(tmp_path / name), *extra]) == 0
    alone, both = (Profile.load(tmp_path / n) for n in ("alone.json", "both.json"))
    measured = sum(truth.predict(s) for s in mixed)
    error = [sum(p.step_model.predict(s) for s in mixed) / measured - 1 for p in (alone, both)]
    assert error[0] < -0.2 and abs(error[1]) < 0.01
    assert both.fit["num_steps"] == 130 and both.notes["refit_with_runs"] == ["run.json"]
    (tmp_path / "empty.json").write_text(json.dumps({"steps": {}}))
    with pytest.raises(ValueError, match="recorded no steps"):
        main(["--refit", str(tmp_path / "grid.json"), "--output", str(tmp_path / "x.json"),
              "--with-run", str(tmp_path / "empty.json")])  # fmt: skip


def test_tune_simulate_confirms_the_best_on_the_engine(tmp_path, tokenizer, make_engine, monkeypatch, capsys):
    """--confirm N reruns the N best one-replica configurations through bench's driver on the engine (here the real
    LLMEngine over the FakeRunner) and records the measured summary beside the predicted one."""
    from batchserve.bench import offline
    from batchserve.cli import main

    built = []
    monkeypatch.setattr(offline, "build_engine", lambda config, like=None, share_runner=True: built.append(
        make_engine(config, tokenizer=tokenizer)) or built[-1])  # fmt: skip
    tokenizer.save_pretrained(tmp_path / "tok")
    Profile("measured", STEP_MODEL, "tiny", "float32", 1024, 1024 * 16 * 512, 4096).save(tmp_path / "p.json")
    argv = ["--simulate", "--profile", str(tmp_path / "p.json"), "--tokenizer", str(tmp_path / "tok"),
            "--workload", "uniform", "--input-len", "16", "--output-len", "8", "--num-requests", "12", "--request-rate", "inf",
            "--batch-sizes", "4,8", "--num-tokens", "256", "--policies", "max_utilization", "--confirm", "2",
            "--output", str(tmp_path / "best.json"), "--results-json", str(tmp_path / "rows.json"), "--no-progress"]  # fmt: skip
    assert main(["tune", *argv]) == 0  # the CLI sends --simulate to the simulator
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert len(built) == 2 and [r["config"]["max_batch_size"] for r in rows[:2]] == [
        b.config.scheduler.max_batch_size for b in built
    ]
    for r in rows[:2]:
        assert (
            r["measured"]["completed"] == 12
            and r["measured"]["total_output_tokens"] == r["summary"]["total_output_tokens"]
        )
    assert "confirmed on the real engine" in capsys.readouterr().out


def test_sim_validate_measured_resimulates_recorded_points(tmp_path, tokenizer, capsys):
    """benchmarks/sim_validate.py --measured: only the simulator runs, at the recorded point with its recorded flags,
    beside the recorded real numbers."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[2] / "benchmarks" / "sim_validate.py"
    spec = importlib.util.spec_from_file_location("sim_validate", path)
    sim_validate = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sim_validate)
    tokenizer.save_pretrained(tmp_path / "tok")
    Profile("measured", STEP_MODEL, "tiny", "float32", 1024, 1024 * 16 * 512, 4096).save(tmp_path / "p.json")
    measured = {"out tok/s": 100.0, "TTFT p50": 50.0, "TTFT p99": 90.0, "TPOT p50": 10.0, "TPOT p99": 20.0}
    argv = ["--workload", "uniform", "--num-requests", "12", "--output-len", "8", "--seed", "0",
            "--tokenizer", str(tmp_path / "tok"), "--max-batch-size", "4", "--request-rate", "20"]  # fmt: skip
    point = {"workload": "uniform", "config": "small", "rate": 20, "load": 0.5, "real_s": 1.0, "argv": argv,
             "measured": measured}  # fmt: skip
    (tmp_path / "validation.json").write_text(json.dumps([point]))
    out = tmp_path / "out"
    assert sim_validate.main(["--profile", str(tmp_path / "p.json"), "--measured", str(tmp_path / "validation.json"),
                              "--out-dir", str(out)]) == 0  # fmt: skip
    (row,) = json.loads((out / "resimulated.json").read_text())
    assert row["measured"] == measured and row["argv"] == argv
    assert row["predicted"]["out tok/s"] > 0 and set(row["predicted"]) == set(measured)
    assert "of 5 cells within target" in capsys.readouterr().out


def test_time_scale_stretches_every_step_and_round_trips(tmp_path, tokenizer, capsys):
    """--time-scale 2: the same schedule (all requests at once), every step twice as long: the mean step, TTFT and
    TPOT double and the throughput halves; the profile's label says so."""
    from batchserve.simulator.cli import main
    from batchserve.simulator.step_model import ScaledStepModel, model_from_dict

    tokenizer.save_pretrained(tmp_path / "tok")
    Profile("measured", STEP_MODEL, "tiny", "float32", 1024, 1024 * 16 * 512, 4096).save(tmp_path / "p.json")
    runs = {}
    for scale in ("1", "2"):
        out = tmp_path / f"out{scale}"
        argv = ["--profile", str(tmp_path / "p.json"), "--tokenizer", str(tmp_path / "tok"), "--workload", "uniform",
                "--num-requests", "24", "--max-batch-size", "8", "--output-dir", str(out), "--no-plots",
                "--time-scale", scale]  # fmt: skip
        assert main(argv) == 0
        (path,) = out.glob("uniform-sim-*/summary.json")
        runs[scale] = json.loads(path.read_text())["runs"]["max_utilization"]
    assert "step times x 2" in capsys.readouterr().out
    one, two = runs["1"], runs["2"]
    assert two["mean_step_ms"] == pytest.approx(2 * one["mean_step_ms"])
    assert two["ttft_ms"]["p50"] == pytest.approx(2 * one["ttft_ms"]["p50"])
    assert two["tpot_ms"]["p50"] == pytest.approx(2 * one["tpot_ms"]["p50"])
    assert two["output_throughput"] == pytest.approx(one["output_throughput"] / 2)
    scaled = ScaledStepModel(STEP_MODEL, 1.25)
    back = model_from_dict(scaled.to_dict())
    shape = StepShape(tokens=70, seqs=8, samples=8, decode_ctx=4000, prefill_pairs=2000)
    assert back.predict(shape) == pytest.approx(1.25 * STEP_MODEL.predict(shape)) and back.kind == "linear"
    assert main(["--profile", str(tmp_path / "p.json"), "--time-scale", "0", "--no-save-result"]) == 2


def test_speed_check_is_measured_over_predicted_on_the_check_grid(make_engine):
    """profile --check times the check's groups on the real engine (here over the FakeRunner): decodes of 1 and 8
    sequences and their prompts; each factor is the measured time of its steps (decode-only, the others) over the
    profile's prediction for the same steps."""
    from batchserve.simulator.profiler import check_speed

    profile = Profile("measured", STEP_MODEL, "tiny", "float32", 1024, 1024 * 16 * 512, 4096)
    engine = make_engine(max_batch_size=8, num_kv_blocks=256, max_model_len=512)
    check = check_speed(engine, profile)
    steps = list(zip(check.timings.shapes, check.timings.seconds, strict=True))
    decodes = [(s, t) for s, t in steps if s.kind == "decode"]
    prompts = [(s, t) for s, t in steps if s.kind != "decode"]
    assert {s.seqs for s, _ in decodes} == {1, 8} and len(prompts) >= 3  # two prompts of 64, eight of 64
    assert len(decodes) >= 3 * (16 - 1)  # three groups of 16 tokens, the first from the prompt's step
    for factor, group in ((check.decode_factor, decodes), (check.factor, prompts)):
        assert factor == pytest.approx(sum(t for _, t in group) / sum(STEP_MODEL.predict(s) for s, _ in group))
    assert check.simulate_flags() == f"--time-scale {check.factor:.3f} --decode-time-scale {check.decode_factor:.3f}"
    assert not engine.has_unfinished_requests()


def test_speed_check_times_on_the_profiles_clock(make_engine):
    """A CPU-clock profile is checked on the CPU clock: the factors come from the clock given, not the wall's."""
    from batchserve.simulator.profiler import check_speed

    profile = Profile("measured", STEP_MODEL, "tiny", "float32", 1024, 1024 * 16 * 512, 4096)
    ticks = iter(range(0, 10**6, 2))  # every reading 2 s after the last: each timed step takes 2 s
    check = check_speed(make_engine(max_batch_size=8, num_kv_blocks=256, max_model_len=512), profile, 0,
                        lambda: float(next(ticks)))  # fmt: skip
    assert set(check.timings.seconds) == {2.0}


def test_decode_time_scale_applies_to_decode_steps_only():
    from batchserve.simulator.step_model import ScaledStepModel, model_from_dict

    scaled = ScaledStepModel(STEP_MODEL, 1.5, decode_factor=0.8)
    decode = StepShape(tokens=8, seqs=8, samples=8, decode_ctx=800)
    mixed = StepShape(tokens=70, seqs=8, samples=8, decode_ctx=700, prefill_pairs=2000)
    back = model_from_dict(scaled.to_dict())
    for model in (scaled, back):
        assert model.predict(decode) == pytest.approx(0.8 * STEP_MODEL.predict(decode))
        assert model.predict(mixed) == pytest.approx(1.5 * STEP_MODEL.predict(mixed))
    assert back.describe() == "step times x 1.5, decode steps x 0.8"
