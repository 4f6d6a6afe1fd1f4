"""Step-time models: StepShape -> seconds. `linear` is fitted to steps measured on this machine (`batchserve
profile`); `roofline` is an estimate for hardware we do not have (analytic.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from batchserve.simulator.shape import FEATURES, StepShape


class StepTimeModel(Protocol):
    kind: str

    def predict(self, shape: StepShape) -> float: ...

    def to_dict(self) -> dict[str, Any]: ...


@dataclass
class LinearStepModel:
    """seconds = sum of non-negative coefficient x feature (FEATURES): a fixed cost per step, per token (the
    projections and MLP), per sequence (host work), per sampled row (LM head, sampler), per K/V position a decode
    reads and per prefill query-key pair (attention). Non-negative so that no extrapolation predicts a negative time."""

    coefficients: dict[str, float]
    kind: str = "linear"

    def predict(self, shape: StepShape) -> float:
        x = shape.features()
        return sum(self.coefficients.get(name, 0.0) * v for name, v in zip(FEATURES, x, strict=True))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "coefficients": dict(self.coefficients)}


@dataclass
class FitReport:
    num_steps: int
    mape: float  # mean |predicted - measured| / measured over held-out steps
    p90_ape: float
    r2: float
    total_error: float  # (sum predicted - sum measured) / sum measured over held-out steps: the run-length error

    def to_dict(self) -> dict[str, float]:
        return dict(vars(self))


def nnls(a: np.ndarray, b: np.ndarray, iters: int = 50) -> np.ndarray:
    """Least squares with x >= 0 by dropping the most negative coefficient until none is (an active-set sketch that
    is exact enough for six well-scaled features; numpy only, no scipy in the environment)."""
    active = list(range(a.shape[1]))
    x = np.zeros(a.shape[1])
    for _ in range(iters):
        sol, *_ = np.linalg.lstsq(a[:, active], b, rcond=None)
        if (sol >= 0).all():
            x[:] = 0
            x[active] = sol
            return x
        active.pop(int(np.argmin(sol)))
        if not active:
            break
    return x


def fit_linear(
    shapes: list[StepShape], seconds: list[float], holdout_every: int = 5
) -> tuple[LinearStepModel, FitReport]:
    """Fit on 4 of every 5 steps, report the error on the fifth; then refit on all. Rows are weighted by 1/seconds so
    the fit minimises relative error (short decode steps count as much as long prefills). Steps the first fit misses
    by far more than the rest (a one-off stall: a new GEMM shape's set-up, the host busy elsewhere) are left out of
    the second fit; the held-out error still counts them."""
    x = np.array([s.features() for s in shapes], dtype=float)
    y = np.array(seconds, dtype=float)
    held = np.arange(len(y)) % holdout_every == holdout_every - 1
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0

    def solve_once(mask: np.ndarray) -> np.ndarray:
        w = 1.0 / y[mask]
        return nnls(x[mask] / scale * w[:, None], y[mask] * w) / scale

    def solve(mask: np.ndarray) -> np.ndarray:
        coef = solve_once(mask)
        rel = np.abs(x @ coef - y) / y
        keep = mask & (rel <= max(0.5, 5 * float(np.median(rel[mask]))))
        return solve_once(keep) if keep.sum() >= len(FEATURES) else coef

    coef = solve(~held) if held.any() and (~held).sum() >= len(FEATURES) else solve(np.ones_like(held))
    test = held if held.any() else np.ones_like(held)
    pred, meas = x[test] @ coef, y[test]
    ape = np.abs(pred - meas) / meas
    ss_res, ss_tot = float(((pred - meas) ** 2).sum()), float(((meas - meas.mean()) ** 2).sum())
    report = FitReport(
        num_steps=len(y), mape=float(ape.mean()), p90_ape=float(np.percentile(ape, 90)),
        r2=1 - ss_res / ss_tot if ss_tot > 0 else math.nan, total_error=float(pred.sum() / meas.sum() - 1),
    )  # fmt: skip
    coef = solve(np.ones_like(held))
    return LinearStepModel({n: float(c) for n, c in zip(FEATURES, coef, strict=True)}), report


@dataclass
class RooflineStepModel:
    """An ESTIMATE from first principles: each step takes the longer of its FLOPs at the achievable compute rate and
    its bytes (weights once per step, K/V read and written) at the achievable bandwidth, plus a fixed host overhead.
    Per-token and per-pair costs come from the model's shapes (analytic.py computes them)."""

    flops_per_token: float  # 2 x the parameters of every projection and the MLP
    flops_per_sample: float  # 2 x the LM head's parameters
    flops_per_pair: float  # attention: QK^T and PV, all layers and heads, per query-key pair
    weight_bytes: float  # read once per step
    kv_bytes_per_token: float  # K and V of one position, all layers
    peak_flops: float  # achievable, not the datasheet's: the preset's peak x its efficiency
    bandwidth: float  # achievable bytes/s
    overhead_s: float  # per step: the host's scheduling, batch building, launches
    overhead_per_seq_s: float = 0.0
    kind: str = "roofline"
    notes: dict[str, Any] = field(default_factory=dict)

    def flops(self, s: StepShape) -> float:
        pairs = s.decode_ctx + s.prefill_pairs
        return self.flops_per_token * s.tokens + self.flops_per_sample * s.samples + self.flops_per_pair * pairs

    def bytes(self, s: StepShape) -> float:
        kv = (s.decode_ctx + s.prefill_ctx + s.tokens) * self.kv_bytes_per_token  # read the context, write the new
        return self.weight_bytes + kv

    def predict(self, shape: StepShape) -> float:
        if shape.seqs == 0:
            return 0.0
        compute = self.flops(shape) / self.peak_flops
        memory = self.bytes(shape) / self.bandwidth
        return max(compute, memory) + self.overhead_s + self.overhead_per_seq_s * shape.seqs

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items()}


def model_from_dict(d: dict[str, Any]) -> StepTimeModel:
    kind = d.get("kind")
    if kind == "linear":
        return LinearStepModel(dict(d["coefficients"]))
    if kind == "roofline":
        return RooflineStepModel(**{k: v for k, v in d.items()})
    raise ValueError(f"unknown step-time model kind {kind!r} (linear, roofline)")
