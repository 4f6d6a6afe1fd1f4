"""benchmarks/slo_mix.py and slo_mix_vllm.py: the mix's simulated run reports every policy it was asked for, vLLM's
per-request times become goodput with the same targets as the other runs, and the vLLM worker's driver adds each
request only once its arrival has passed and stamps its first and last tokens at the step that returned them."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
PROFILE = BENCHMARKS / "profiles" / "smollm2-bf16-1thread-xeon-amx-2cpu-v2.json"


@pytest.fixture(scope="module")
def scripts():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("slo_mix"), importlib.import_module("slo_mix_vllm")
    finally:
        sys.path.remove(str(BENCHMARKS))


def test_simulated_run_reports_the_policies_asked(scripts, tmp_path):
    slo_mix, _ = scripts
    out = tmp_path / "rows.json"
    slo_mix.main(["--profile", str(PROFILE), "--requests", "12", "--rate", "1", "--policies", "fcfs,slo",
                  "--json", str(out)])  # fmt: skip
    rows = json.loads(out.read_text())
    assert rows["num_requests"] == 12 and rows["threads"] == 1
    assert set(rows["simulated"]) == {"fcfs", "slo"}
    for row in rows["simulated"].values():
        assert 0 <= row["attainment"] <= 1
        assert row["goodput"] == pytest.approx(row["attainment"] * 12 / row["duration_s"])


def test_unknown_policy_is_refused_by_name(scripts):
    slo_mix, _ = scripts
    with pytest.raises(SystemExit, match="nope"):
        slo_mix.main(["--profile", str(PROFILE), "--requests", "4", "--rate", "1", "--policies", "fcfs,nope"])


def test_vllm_times_become_goodput_with_the_same_targets(scripts):
    slo_mix, _ = scripts
    Req = slo_mix.BenchRequest
    requests = [Req("a", [1] * 50, 11, "short", ttft_slo_ms=500, tpot_slo_ms=250),
                Req("b", [1] * 50, 11, "short", ttft_slo_ms=500, tpot_slo_ms=250),
                Req("c", [1] * 2000, 11, "long", ttft_slo_ms=10_000, tpot_slo_ms=250)]  # fmt: skip
    records = [  # a: within both; b: first token 0.6 s after arrival; c: TPOT (3.0 - 1.0) / 10 = 200 ms
        {"request_id": "a", "arrival_s": 0.0, "first_token_s": 0.4, "finish_s": 1.4, "output_len": 11},
        {"request_id": "b", "arrival_s": 0.5, "first_token_s": 1.1, "finish_s": 2.0, "output_len": 11},
        {"request_id": "c", "arrival_s": 0.0, "first_token_s": 1.0, "finish_s": 4.0, "output_len": 11},
    ]
    results, duration = slo_mix.vllm_results(records, requests)
    assert duration == 4.0
    row = slo_mix.summary(results, duration, requests)
    assert row["attainment"] == pytest.approx(1 / 3)  # c's TPOT is 300 ms: (4.0 - 1.0) / 10
    assert row["short_ttft_miss"] == pytest.approx(0.5)
    assert row["long_tok_s"] == pytest.approx(11 / 4.0)


class StepByStep:
    """The part of vLLM's LLMEngine the worker calls (add_request, step), standing in for it where vLLM is not
    installed: each step takes `step_s` seconds and gives every request one more token (cumulative outputs)."""

    def __init__(self, step_s: float) -> None:
        self.step_s, self.live, self.added = step_s, {}, []

    def add_request(self, request_id, prompt, params, priority=0):
        self.live[request_id] = [0, params.max_tokens]
        self.added.append((request_id, priority))

    def step(self):
        import time

        time.sleep(self.step_s)
        outs = []
        for rid, state in list(self.live.items()):
            state[0] += 1
            done = state[0] == state[1]
            outs.append(SimpleNamespace(request_id=rid, finished=done,
                                        outputs=[SimpleNamespace(token_ids=[7] * state[0])]))  # fmt: skip
            if done:
                del self.live[rid]
        return outs


def test_worker_adds_on_arrival_and_stamps_tokens(scripts, monkeypatch):
    _, worker = scripts
    monkeypatch.setattr(worker, "sampling", lambda n: SimpleNamespace(max_tokens=n))
    engine = StepByStep(0.02)
    trace = [{"request_id": "late", "category": "long", "prompt_token_ids": [1], "max_tokens": 2, "arrival_s": 0.15},
             {"request_id": "early", "category": "short", "prompt_token_ids": [1], "max_tokens": 3,
              "arrival_s": 0.0}]  # fmt: skip
    done = {r["request_id"]: r for r in worker.drive(engine, trace, {"short": 0, "long": 1})}
    assert engine.added == [("early", 0), ("late", 1)]
    early, late = done["early"], done["late"]
    assert early["output_len"] == 3 and late["output_len"] == 2
    assert 0.02 <= early["first_token_s"] < early["finish_s"] < 0.15  # served before the late one arrived
    assert late["first_token_s"] >= 0.15 + 0.02 and late["finish_s"] > late["first_token_s"]


def test_short_waits_charge_the_queue_to_the_batch_slots_and_the_reserve_clears_them(scripts, monkeypatch):
    """At 4 requests/s the 32 slots fill with summaries and questions: the short requests' queued time under
    `isolate` is all spent with every slot taken; under `slo` almost none of it, and without its slot reserve most."""
    slo_mix, _ = scripts
    args = slo_mix.parse_args(["--profile", str(PROFILE)])
    profile, requests = slo_mix.Profile.load(PROFILE), slo_mix.make_requests(args, 80, 0)
    isolate, slo = (slo_mix.short_waits(name, profile, requests, 4.0, 0) for name in ("isolate", "slo"))
    assert isolate["seconds"] > 0 and isolate["slots"] > 0.9 and 0 < isolate["summaries_share"] < 1
    assert sum(isolate[k] for k in ("slots", "tokens", "other")) == pytest.approx(1.0)
    assert slo["slots"] < 0.1
    monkeypatch.setitem(slo_mix.POLICIES, "slo", slo_mix.POLICIES["slo"] | {"slo_reserved_slots": 0})
    assert slo_mix.short_waits("slo", profile, requests, 4.0, 0)["slots"] > 0.5


def test_run_speed_scales_decodes_and_prompt_steps_apart(scripts):
    """Decodes ran 1.3x the profile's time, steps with prompt tokens 0.9x: the prompt steps' factor leaves the
    decodes out (one factor for all would charge the prompt steps the decodes' slowdown)."""
    slo_mix, _ = scripts
    profile = slo_mix.Profile.load(PROFILE)
    shapes = [slo_mix.StepShape(tokens=8, seqs=8, samples=8, decode_ctx=800),
              slo_mix.StepShape(tokens=136, seqs=9, samples=8, decode_ctx=800, prefill_pairs=9000, prefill_seqs=1),
              slo_mix.StepShape(tokens=512, seqs=1, samples=1, prefill_pairs=131_328, prefill_seqs=1)]  # fmt: skip
    timed = object.__new__(slo_mix.TimedSteps)
    timed.steps = [(s, 9.9, profile.step_model.predict(s) * (1.3 if s.kind == "decode" else 0.9)) for s in shapes]
    speed = timed.speed(profile, cpu=True)
    assert speed["decode"] == pytest.approx(1.3) and speed["prompt"] == pytest.approx(0.9)
    assert speed["mixed"] == pytest.approx(0.9) and 0.9 < speed["all"] < 1.3


def test_the_ceiling_is_every_request_within_its_targets(scripts):
    slo_mix, _ = scripts
    line = slo_mix.ceiling({"fcfs": {"goodput": 0.5, "duration_s": 250.0}}, 200)
    assert "0.800 req/s" in line and "1.60x FCFS" in line
