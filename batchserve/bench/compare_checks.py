"""What `bench --compare-static` says besides its ratio: how long it will take, before it starts, and whether the
host's noise during the runs was larger than the difference it reports.

The estimate comes from the workload alone (bench may not import the simulator, and a simulator profile of this host
takes minutes to measure): static batching runs batches of max_batch_size in arrival order, each its prompts' prefill
chunks then its longest output; continuous batching needs at least the decode steps the batch size forces and the
longest request. Times are those steps at the warm-up's median decode step, so a rough figure: steps grow with the
context.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence

from batchserve.bench.metrics import StepSample
from batchserve.bench.trace import RunTrace
from batchserve.bench.workloads import BenchRequest

MIN_STEPS_FOR_NOISE = 10


def estimate_steps(requests: Sequence[BenchRequest], max_batch_size: int, max_num_tokens: int) -> tuple[int, int]:
    """(static steps, continuous steps) the workload needs at least, all requests waiting from the start."""
    if not requests:
        return 0, 0
    static = 0
    for i in range(0, len(requests), max_batch_size):
        batch = requests[i : i + max_batch_size]
        static += math.ceil(sum(r.prompt_len for r in batch) / max_num_tokens) + max(r.output_len for r in batch)
    prefill = math.ceil(sum(r.prompt_len for r in requests) / max_num_tokens)
    decode = max(math.ceil(sum(r.output_len for r in requests) / max_batch_size), max(r.output_len for r in requests))
    return static, prefill + decode


def estimate_line(steps: tuple[int, int], step_s: float | None, runs: int = 1) -> str:
    """The estimate in words: steps, and time at `step_s` a step when the warm-up measured one."""
    static, dynamic = steps[0] * runs, steps[1] * runs
    line = f"estimate: at least {static} static + {dynamic} continuous steps"
    if step_s:
        seconds = (static + dynamic) * step_s
        line += f", about {_duration(seconds)} at the warm-up's median decode step ({1000 * step_s:.0f} ms)"
    return line + " (a rough figure: steps grow with the context; prompts in a static batch wait for its end)"


def _duration(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def step_noise(steps: Sequence[StepSample]) -> float | None:
    """Spread of the times of steps that should take the same time (decode-only steps of the most common batch
    size), as p90 / p10 - 1; None when too few such steps."""
    groups: dict[int, list[float]] = defaultdict(list)
    for step in steps:
        if step.num_prefill_tokens == 0 and step.num_decode_tokens > 0:
            groups[step.num_scheduled_seqs].append(step.end - step.start)
    times = max(groups.values(), key=len, default=[])
    if len(times) < MIN_STEPS_FOR_NOISE:
        return None
    deciles = statistics.quantiles(times, n=10)
    return deciles[-1] / deciles[0] - 1 if deciles[0] > 0 else None


def noise_warning(static: RunTrace, dynamic: RunTrace, ratio: float | None) -> str | None:
    """A warning when same-shape steps varied more than the throughput difference the comparison reports."""
    spreads = [n for n in (step_noise(static.steps), step_noise(dynamic.steps)) if n is not None]
    if ratio is None or not spreads or not math.isfinite(ratio):
        return None
    noise, effect = max(spreads), abs(ratio - 1)
    if noise <= effect:
        return None
    return (
        f"warning: steps of the same shape varied by {100 * noise:.0f}% (p10 to p90) during the runs, more than the "
        f"{100 * effect:.1f}% difference reported: the host was busy or its clock changed; the ratio is only as "
        "good as that (rerun on a quiet host, or compare output tokens/step, which steps' speed does not change)"
    )
