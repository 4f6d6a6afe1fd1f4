"""k by load from measured step cost (speculative_config k_policy "cost"): the draft length that maximises the tokens a
step of the running decodes emits per second, from an online fit of step time against tokens computed and the
acceptance rate seen so far. Plain Python: the engine feeds it each step's token count and duration.

With acceptance rate a, a decode given k drafts emits (1 - a^(k+1)) / (1 - a) tokens on average (the accepted prefix
plus the target's own token). A step of B decodes with k drafts each computes B (1 + k) tokens; on a memory-bound
step the extra tokens cost little and k grows, on a compute-bound one they cost their share and k falls to 0.
"""

from __future__ import annotations

from dataclasses import dataclass

PRIOR_ACCEPTANCE = 0.5  # until drafts have been verified
MIN_OBSERVATIONS = 8  # steps seen before the fit is trusted (the ramp decides until then)


@dataclass
class StepCostModel:
    """Step seconds ~ fixed + per_token x tokens, fitted by exponentially weighted least squares (recent steps count
    most, so a change of load or of the host's other work moves the fit)."""

    decay: float = 0.98
    _weight: float = 0.0
    _sum_x: float = 0.0
    _sum_y: float = 0.0
    _sum_xx: float = 0.0
    _sum_xy: float = 0.0
    observations: int = 0

    def observe(self, tokens: int, seconds: float) -> None:
        if tokens <= 0 or seconds <= 0:
            return
        d = self.decay
        self._weight = d * self._weight + 1
        self._sum_x = d * self._sum_x + tokens
        self._sum_y = d * self._sum_y + seconds
        self._sum_xx = d * self._sum_xx + tokens * tokens
        self._sum_xy = d * self._sum_xy + tokens * seconds
        self.observations += 1

    def coefficients(self) -> tuple[float, float] | None:
        """(fixed seconds, seconds per token), or None while the steps seen cannot separate the two."""
        if self.observations < MIN_OBSERVATIONS:
            return None
        variance = self._weight * self._sum_xx - self._sum_x**2
        if variance <= 1e-9 * self._sum_xx * self._weight:  # every step had about the same token count
            return None
        per_token = (self._weight * self._sum_xy - self._sum_x * self._sum_y) / variance
        fixed = (self._sum_y - per_token * self._sum_x) / self._weight
        return max(fixed, 0.0), max(per_token, 0.0)


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a decode emits from a verification step with k drafts (at least the target's own one)."""
    if acceptance >= 1.0:
        return k + 1.0
    return (1.0 - acceptance ** (k + 1)) / (1.0 - acceptance)


def best_k(num_decodes: int, acceptance: float, max_k: int, fixed_s: float, per_token_s: float) -> int:
    """The k in 0..max_k with the most emitted tokens per second for a step of num_decodes decodes."""

    def rate(k: int) -> float:
        seconds = fixed_s + per_token_s * num_decodes * (1 + k)
        return num_decodes * expected_tokens(acceptance, k) / seconds if seconds > 0 else 0.0

    return max(range(max_k + 1), key=lambda k: (rate(k), -k))  # on a tie, fewer drafts
