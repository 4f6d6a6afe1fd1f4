"""The goodput rule: against the service-level targets (the server's ttft_slo_ms / tpot_slo_ms, or doctor's
--slo-ttft-ms / --slo-tpot-ms), too few finished requests met both, and the knob that answers the kind of miss:
- tokens came too slowly (TPOT misses) in steps that carried long prefill chunks: long-prompt isolation, a per-step
  prefill budget for long prompts (long_prefill_token_threshold, sized by the fitted step time so that a step with the
  running decodes stays inside the TPOT target) and one long prefill at a time (max_long_partial_prefills 1);
- first tokens came too late (TTFT misses) while requests waited: SLO-aware admission, so that the requests that can
  still meet their target go first and the ones that cannot are served after them (or refused, where the client can
  retry elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

from batchserve.doctor.observe import Finished, Observation
from batchserve.simulator.shape import StepShape
from batchserve.simulator.step_model import StepTimeModel

GOODPUT_TARGET = 0.9  # below this share of requests meeting both targets, goodput has fallen
MIN_REQUESTS = 20
LONG_CHUNK_SHARE = 0.05  # steps that carried a long prefill chunk beside decodes: at least this share of the steps
SMALLEST_BUDGET = 64  # a prefill budget below this many tokens a step would starve long prompts


@dataclass(frozen=True)
class Targets:
    ttft_s: float | None
    tpot_s: float | None

    def describe(self) -> str:
        parts = [f"TTFT <= {1000 * self.ttft_s:g} ms" if self.ttft_s else "", f"TPOT <= {1000 * self.tpot_s:g} ms"
                 if self.tpot_s else ""]  # fmt: skip
        return " and ".join(p for p in parts if p)


def targets_of(obs: Observation) -> Targets | None:
    """The targets the server was given (ttft_slo_ms / tpot_slo_ms in its configuration); None without any."""
    ttft, tpot = (_float(obs.config.get(name)) for name in ("ttft_slo_ms", "tpot_slo_ms"))
    if not ttft and not tpot:
        return None
    return Targets(ttft / 1000 if ttft else None, tpot / 1000 if tpot else None)


def _float(value: object) -> float | None:
    try:
        return float(value) if value not in (None, "", "None") else None  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None


def tpot_of(r: Finished) -> float | None:
    if r.ttft_s is None or r.output_tokens < 2:
        return None
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)


@dataclass
class Misses:
    ttft: int
    tpot: int
    met: int
    total: int

    @property
    def attainment(self) -> float:
        return self.met / self.total if self.total else 1.0


def count_misses(obs: Observation, targets: Targets) -> Misses:
    ttft = tpot = met = 0
    for r in obs.requests:
        late = targets.ttft_s is not None and (r.ttft_s is None or r.ttft_s > targets.ttft_s)
        slow = targets.tpot_s is not None and (tpot_of(r) or 0.0) > targets.tpot_s
        ttft, tpot, met = ttft + late, tpot + slow, met + (not late and not slow)
    return Misses(ttft, tpot, met, len(obs.requests))


def prefill_budget(model: StepTimeModel | None, obs: Observation, tpot_s: float) -> int | None:
    """The most prompt tokens a step can add to the running decodes and stay inside `tpot_s` (by the fitted step
    time); None without a fitted model."""
    if model is None:
        return None
    decodes = round(obs.mean([s.decode_tokens for s in obs.steps if s.decode_tokens]) or 1)
    fits = lambda extra: model.predict(StepShape(tokens=decodes + extra, seqs=decodes + 1)) <= tpot_s  # noqa: E731
    low, high = 0, max(SMALLEST_BUDGET, obs.knob("max_num_tokens", 2048))
    while low < high:  # the largest budget that fits (binary search on a time that never falls as tokens grow)
        middle = (low + high + 1) // 2
        low, high = (middle, high) if fits(middle) else (low, middle - 1)
    return max(SMALLEST_BUDGET, low)


def long_chunk_steps(obs: Observation, threshold: int) -> int:
    """Steps where decodes shared the step with more than `threshold` prompt tokens."""
    return sum(1 for s in obs.steps if s.decode_tokens and s.prefill_tokens > threshold)
