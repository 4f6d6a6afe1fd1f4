"""`batchserve tune --simulate --slo ttft=...,tpot=...` searches the long-prompt and SLO-admission knobs too, and
picks the configuration with the best goodput on the mixed workload."""

from __future__ import annotations

import json

import pytest

from batchserve.simulator.profile_file import Profile
from batchserve.simulator.step_model import LinearStepModel
from batchserve.simulator.tune_sim import build_parser, parse_slo

# attention's quadratic term dominates long prompts, as on a CPU: a whole long prefill in one step stalls the batch
STEP_MODEL = LinearStepModel({"steps": 5e-3, "tokens": 5e-5, "seqs": 1e-5, "prefill_pairs": 4e-7})


def test_tune_picks_long_prompt_isolation_for_the_mix(tmp_path, tokenizer, capsys):
    from batchserve.cli import main

    tokenizer.save_pretrained(tmp_path / "tok")
    Profile("measured", STEP_MODEL, "tiny", "float32", 1024, 1024 * 16 * 2048, 4096).save(tmp_path / "p.json")
    out = tmp_path / "best.json"
    argv = ["--simulate", "--profile", str(tmp_path / "p.json"), "--tokenizer", str(tmp_path / "tok"),
            "--workload", "mixed", "--long-input-len", "1500", "--long-output-len", "100", "--output-len", "40",
            "--input-len", "30", "--num-requests", "80", "--request-rate", "6", "--batch-sizes", "32",
            "--num-tokens", "4096", "--policies", "max_utilization", "--slo", "ttft=300,tpot=60",
            "--prefill-thresholds", "0,64", "--slo-admissions", "off,refuse", "--min-attainment", "0.99",
            "--output", str(out), "--results-json", str(tmp_path / "rows.json")]  # fmt: skip
    main(["tune", *argv])
    rows = json.loads((tmp_path / "rows.json").read_text())["rows"]
    assert len(rows) == 4
    by_knobs = {(r["config"]["long_prefill_token_threshold"], r["config"]["slo_admission"]): r for r in rows}
    baseline = by_knobs[(0, "off")]["summary"]["goodput"]
    best = rows[0]
    assert best["config"]["long_prefill_token_threshold"] == 64
    assert best["summary"]["goodput"] > 1.2 * baseline
    written = json.loads(out.read_text())
    assert written["long_prefill_token_threshold"] == 64 and written["max_long_partial_prefills"] == 1
    if best["config"]["slo_admission"] != "off":  # the targets become the engine's defaults
        assert (written["ttft_slo_ms"], written["tpot_slo_ms"]) == (300, 60)
    assert "long>" in capsys.readouterr().out


@pytest.mark.parametrize("text", ["ttft=0", "ttft=-5", "latency=5", "ttft=fast"])
def test_a_bad_slo_flag_is_refused(text):
    args = build_parser().parse_args(["--slo", text])
    with pytest.raises(ValueError, match="--slo"):
        parse_slo(args)


def test_the_slo_flag_sets_both_targets():
    args = build_parser().parse_args(["--slo", "ttft=400,tpot=80"])
    parse_slo(args)
    assert (args.slo_ttft_ms, args.slo_tpot_ms) == (400, 80)


def test_the_slot_reserve_is_searched_under_slo_admission_only():
    from batchserve.simulator.tune_sim import engine_options, grid

    args = build_parser().parse_args(["--slo-admissions", "off,refuse", "--slo-reserved-slots-list", "auto,0,4"])
    points = {(p["slo_admission"], p["slo_reserved_slots"]) for p in grid(args)}
    assert points == {("off", None), ("refuse", None), ("refuse", 0), ("refuse", 4)}
    chosen = {p["slo_reserved_slots"]: engine_options(p, args) for p in grid(args) if p["slo_admission"] == "refuse"}
    assert "slo_reserved_slots" not in chosen[None] and chosen[4]["slo_reserved_slots"] == 4


@pytest.mark.parametrize("text", ["-1", "many"])
def test_a_bad_reserved_slots_list_is_refused(text):
    from batchserve.simulator.tune_sim import grid

    with pytest.raises(ValueError, match="--slo-reserved-slots-list"):
        grid(build_parser().parse_args(["--slo-reserved-slots-list", text]))
