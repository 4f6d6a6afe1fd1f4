"""benchmarks/step_timeline.py: perf samples put in the step and the innermost engine phase running at their time,
then in an op by their symbol."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def step_timeline():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module("step_timeline")
    finally:
        sys.path.remove(str(BENCHMARKS))


class FakeEngine:
    """An engine whose step schedules, runs the model and the lm_head, samples and emits outputs, noting the clock
    inside each phase so that a test can place samples there."""

    def __init__(self, prefill_rows: int, decode_rows: int) -> None:
        self.seen: dict[str, float] = {}
        self.scheduler = SimpleNamespace(schedule=self._noting("schedule"),
                                         update_from_output=self._noting("update"))  # fmt: skip
        model = SimpleNamespace(forward=self._noting("forward"), compute_logits=self._noting("logits"))
        self.runner = SimpleNamespace(model=model, _execute=self._execute, _logits_and_sample=self._logits_and_sample,
                                      _sample=self._noting("sample"))  # fmt: skip
        self._process = self._noting("process")
        self.last_stats = SimpleNamespace(num_prefill_tokens=prefill_rows, num_decode_tokens=decode_rows,
                                          num_scheduled_seqs=decode_rows + (prefill_rows > 0), kv_slots_filled=99)  # fmt: skip

    def _noting(self, name: str):
        def call(*args, **kwargs):
            import time

            self.seen[name] = time.monotonic()

        return call

    def _execute(self):
        self.runner.model.forward()
        self.runner._logits_and_sample()

    def _logits_and_sample(self):
        self.runner.model.compute_logits()
        self.runner._sample()

    def step(self):
        self.scheduler.schedule()
        self.runner._execute()
        self.scheduler.update_from_output()
        self._process()


def test_samples_land_in_their_step_and_innermost_phase(step_timeline):
    engine = FakeEngine(prefill_rows=0, decode_rows=40)
    timeline = step_timeline.Timeline()
    timeline.watch(engine)
    engine.step()
    seen = engine.seen
    samples = [
        (seen["schedule"], "_PyEval_EvalFrameDefault (libpython3.11.so)"),
        (seen["forward"], "[unknown] (/tmp/perf-1.map)"),
        (seen["forward"], "(anonymous namespace)::decode_items_bf16<4> (kernels.so)"),
        (seen["forward"], "(anonymous namespace)::score_group<4, float> (kernels.so)"),
        (seen["forward"], "rms_norm (kernels.so)"),
        (seen["forward"], "clear_page_erms ([kernel.kallsyms])"),
        (seen["logits"], "(anonymous namespace)::panel_block<12> (kernels.so)"),
        (seen["sample"], "argmax_rows (kernels.so)"),
        (seen["update"], "_PyEval_EvalFrameDefault (libpython3.11.so)"),
        (seen["process"], "_PyEval_EvalFrameDefault (libpython3.11.so)"),
        (seen["process"] + 10.0, "after the steps: still the last step's, but outside every phase"),
    ]
    groups, symbols = step_timeline.breakdown(timeline, samples)
    assert list(groups) == ["decode-only steps, 33-48 rows"]
    assert groups["decode-only steps, 33-48 rows"] == {
        "schedule": 1,
        "layers: GEMMs": 1,
        "layers: decode attention": 2,
        "layers: norms, RoPE, SiLU": 1,
        "layers: pages touched first (kernel)": 1,
        "lm_head: GEMMs": 1,
        "sampling": 1,
        "outputs": 2,
    }
    assert symbols["layers: decode attention"] == {
        "(anonymous namespace)::decode_items_bf16<4> (kernels.so)": 1,
        "(anonymous namespace)::score_group<4, float> (kernels.so)": 1,
    }
    assert [s.rows for s in timeline.steps] == [40] and timeline.steps[0].cpu_s >= 0


def test_a_step_with_prompt_rows_is_a_prefill_step(step_timeline):
    engine = FakeEngine(prefill_rows=2048, decode_rows=12)
    timeline = step_timeline.Timeline()
    timeline.watch(engine)
    engine.step()
    groups, _ = step_timeline.breakdown(
        timeline, [(engine.seen["forward"], "(anonymous namespace)::dot_items<64> (k.so)")]
    )
    assert groups == {"prefill-carrying steps": {"layers: prefill attention": 1}}
    assert step_timeline.step_group(timeline.steps[0]) == "prefill-carrying steps"
