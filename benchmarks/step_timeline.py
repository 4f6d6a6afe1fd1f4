"""Where a workload's engine steps spend their CPU time, by phase and by op: the engine's methods are wrapped so that
each records when the step enters and leaves it (on CLOCK_MONOTONIC, perf's clock with `-k monotonic`), and each
perf sample is put in the step and the innermost phase running at its time, then in an op by its symbol.

Used by step_profile.py --workload; the phases are

    schedule     the scheduler's decision (admission, block allocation)
    prepare      the runner's request table and packed batch
    layers       the model's forward through the decoder layers (split by op, from the samples' symbols)
    lm_head      compute_logits on the sampled rows
    logits copy  what lies between: the rows picked, the logits made float32
    sampling     the sampling metadata, the sampler, the ids back to the request table
    outputs      the scheduler's update, detokenization, the step's output objects
    step, other  the rest of engine.step
"""

from __future__ import annotations

import bisect
import dataclasses
import functools
import subprocess
import time
from pathlib import Path

# symbol substrings -> op (first match wins); oneDNN's generated GEMM code has no symbol: perf names its map file
NORMS = "norms, RoPE, SiLU"
PAGES = "pages touched first (kernel)"
OPS = (
    ("decode_items", "decode attention"), ("decode_attention", "decode attention"), ("decode_heads", "decode attention"),
    ("score_group", "decode attention"), ("prefill", "prefill attention"),
    ("dot_items", "prefill attention"), ("pack_kv", "prefill attention"), ("panel_block", "GEMMs"),
    ("gemm", "GEMMs"), ("dnnl", "GEMMs"), ("/perf-", "GEMMs"), ("rms_norm", NORMS), ("rope", NORMS),
    ("silu", NORMS), ("argmax", "argmax"), ("clear_page", PAGES), ("page_fault", PAGES),
    ("kernel.kallsyms", "kernel"), ("libpython", "interpreter"),
)  # fmt: skip
NATIVE_PHASES = ("layers", "lm_head")  # phases whose samples are split by op


@dataclasses.dataclass
class StepTime:
    index: int
    start: float  # CLOCK_MONOTONIC seconds
    cpu_s: float  # this process's CPU seconds in the step
    rows: int  # rows through the layers
    sampled: int  # rows through the lm_head
    kv_tokens: int  # K/V slots attention read
    prefill_rows: int


class Timeline:
    """Phase changes on CLOCK_MONOTONIC, recorded by wrappers around an engine's methods."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self.labels: list[str] = []
        self.stack: list[str] = ["outside steps"]
        self.steps: list[StepTime] = []
        self._starts: list[float] = []

    def _mark(self, label: str) -> None:
        self.times.append(time.monotonic())
        self.labels.append(label)

    def wrap(self, owner, name: str, phase: str) -> None:
        inner = getattr(owner, name)

        @functools.wraps(inner)
        def timed(*args, **kwargs):
            self.stack.append(phase)
            self._mark(phase)
            try:
                return inner(*args, **kwargs)
            finally:
                self.stack.pop()
                self._mark(self.stack[-1])

        setattr(owner, name, timed)

    def watch(self, engine) -> None:
        """Wrap the engine's step and its phases; each step's CPU time and shape are kept."""
        runner, model = engine.runner, engine.runner.model
        self.wrap(engine.scheduler, "schedule", "schedule")
        self.wrap(runner, "_execute", "prepare")
        self.wrap(model, "forward", "layers")
        self.wrap(model, "compute_logits", "lm_head")
        self.wrap(runner, "_logits_and_sample", "logits copy")
        self.wrap(runner, "_sample", "sampling")
        self.wrap(engine.scheduler, "update_from_output", "outputs")
        self.wrap(engine, "_process", "outputs")
        step = engine.step

        def timed_step():
            start, cpu = time.monotonic(), time.process_time()
            self.stack.append("step, other")
            self._mark("step, other")
            try:
                return step()
            finally:
                self.stack.pop()
                self._mark(self.stack[-1])
                stats = engine.last_stats
                rows = stats.num_prefill_tokens + stats.num_decode_tokens
                if rows:
                    self.steps.append(StepTime(len(self.steps), start, time.process_time() - cpu, rows,
                                               stats.num_scheduled_seqs, stats.kv_slots_filled,
                                               stats.num_prefill_tokens))  # fmt: skip

        engine.step = timed_step

    def phase_at(self, t: float) -> str:
        i = bisect.bisect_right(self.times, t) - 1
        return self.labels[i] if i >= 0 else "outside steps"

    def step_at(self, t: float) -> StepTime | None:
        if len(self._starts) != len(self.steps):
            self._starts = [s.start for s in self.steps]
        i = bisect.bisect_right(self._starts, t) - 1
        return self.steps[i] if i >= 0 else None


def op_of(symbol: str) -> str:
    return next((op for key, op in OPS if key in symbol), "other native (dispatch, malloc, copies)")


def samples(data: Path) -> list[tuple[float, str]]:
    """(CLOCK_MONOTONIC time, symbol or else the file it lies in) of each sample of a `perf record -k monotonic`
    file."""
    text = subprocess.run(["perf", "script", "-i", str(data), "-F", "time,ip,sym,dso", "--ns"], capture_output=True,
                          text=True, check=False).stdout  # fmt: skip
    out = []
    for line in text.splitlines():
        head, _, rest = line.strip().partition(":")
        fields = rest.split(None, 1)  # the address, then "symbol+offset (file)" or "[unknown] (file)"
        try:
            out.append((float(head), fields[1] if len(fields) > 1 else "[unknown]"))
        except ValueError:
            continue
    return out


def step_group(step: StepTime) -> str:
    if step.prefill_rows:
        return "prefill-carrying steps"
    low = (step.rows - 1) // 16 * 16 + 1
    return f"decode-only steps, {low}-{low + 15} rows"


def breakdown(timeline: Timeline, perf_samples: list[tuple[float, str]]) -> tuple[dict, dict]:
    """Samples by step group, then by 'phase' or 'phase: op'; and by part, then by symbol."""
    groups: dict[str, dict[str, int]] = {}
    symbols: dict[str, dict[str, int]] = {}
    for t, symbol in perf_samples:
        step = timeline.step_at(t)
        phase = timeline.phase_at(t)
        if step is None or phase == "outside steps":
            continue
        part = f"{phase}: {op_of(symbol)}" if phase in NATIVE_PHASES else phase
        counts = groups.setdefault(step_group(step), {})
        counts[part] = counts.get(part, 0) + 1
        by_symbol = symbols.setdefault(part, {})
        by_symbol[symbol] = by_symbol.get(symbol, 0) + 1
    return groups, symbols
