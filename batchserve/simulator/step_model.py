"""Step-time models: StepShape -> seconds. `linear` is fitted to steps measured on this machine (`batchserve
profile`); `roofline` is an estimate for hardware we do not have (analytic.py)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, Protocol

import numpy as np

from batchserve.simulator.shape import FEATURES, StepShape


class StepTimeModel(Protocol):
    kind: str

    def predict(self, shape: StepShape) -> float: ...

    def to_dict(self) -> dict[str, Any]: ...


# Token counts where the fitted time per token may change. A CPU GEMM's time is nearly flat in its rows for a few rows
# (the weights' bandwidth bounds it) and then rises (compute bounds it), so a step's time is not linear in its tokens.
KNOTS = (8, 32, 128, 512)


def feature_names(knots: tuple[int, ...] = ()) -> tuple[str, ...]:
    return (*FEATURES, *(f"tokens>{k}" for k in knots))


def features(shape: StepShape, knots: tuple[int, ...] = ()) -> list[float]:
    """The shape's regressors (feature_names order): FEATURES, then max(0, tokens - k) for each knot k."""
    return [*shape.features(), *(max(0, shape.tokens - k) for k in knots)]


@dataclass
class LinearStepModel:
    """seconds = sum of non-negative coefficient x feature (feature_names(knots)): a fixed cost per step, per token
    (the projections and MLP), per sequence (host work), per sampled row (LM head, sampler), per K/V position a decode
    reads and per prefill query-key pair (attention); and with knots, an extra cost per token past each knot, so that
    the time in tokens is piecewise linear: flat-then-rising, as a GEMM's time in its rows. Non-negative so that no
    extrapolation predicts a negative time (and the time never falls as a step grows). No knots: the plain linear
    model of the first profiles."""

    coefficients: dict[str, float]
    knots: tuple[int, ...] = ()
    kind: str = "linear"

    def __post_init__(self) -> None:
        self.knots = tuple(sorted(int(k) for k in self.knots))
        self.names = feature_names(self.knots)

    def predict(self, shape: StepShape) -> float:
        x = features(shape, self.knots)
        return sum(self.coefficients.get(name, 0.0) * v for name, v in zip(self.names, x, strict=True))

    def token_slopes(self) -> list[tuple[int, float]]:
        """(from this many tokens, seconds per token above it) for each piece of the time in tokens."""
        terms = ("tokens", *self.names[len(FEATURES) :])
        return list(zip((0, *self.knots), accumulate(self.coefficients.get(n, 0.0) for n in terms), strict=True))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "coefficients": dict(self.coefficients), "knots": list(self.knots)}


@dataclass
class FitReport:
    """Held-out errors: each step predicted by the fit on the other folds (in-sample when there are too few steps)."""

    num_steps: int
    mape: float  # mean |predicted - measured| / measured
    p90_ape: float
    r2: float
    total_error: float  # (sum predicted - sum measured) / sum measured: the run-length error
    by_kind: dict[str, dict[str, float]] = field(default_factory=dict)  # decode, prefill, mixed steps
    decode_by_seqs: dict[str, dict[str, float]] = field(default_factory=dict)  # decode steps by batch size

    def to_dict(self) -> dict[str, Any]:
        return dict(vars(self))


STEP_KINDS = ("decode", "prefill", "mixed")
DECODE_GROUPS = ((1, "1"), (2, "2"), (4, "3-4"), (8, "5-8"), (15, "9-15"), (math.inf, "16+"))  # (up to seqs, label)


def decode_group(seqs: int) -> str:
    return next(label for most, label in DECODE_GROUPS if seqs <= most)


def group_errors(
    groups: list[str], order: tuple[str, ...], predicted: np.ndarray, measured: np.ndarray
) -> dict[str, dict[str, float]]:
    """Steps, mean |error| and bias (sum predicted / sum measured - 1) of each group's steps, groups in `order`: where
    a model bends away from the machine."""
    out = {}
    for g in order:
        mask = np.array([x == g for x in groups], dtype=bool)
        if mask.any():
            p, m = predicted[mask], measured[mask]
            out[g] = {"steps": int(mask.sum()), "mape": float((abs(p - m) / m).mean()),
                      "bias": float(p.sum() / m.sum() - 1)}  # fmt: skip
    return out


def error_report(shapes: list[StepShape], predicted: np.ndarray, measured: np.ndarray) -> FitReport:
    ape = np.abs(predicted - measured) / measured
    ss_res, ss_tot = float(((predicted - measured) ** 2).sum()), float(((measured - measured.mean()) ** 2).sum())
    decodes = [i for i, s in enumerate(shapes) if s.kind == "decode"]
    decode_labels = tuple(label for _, label in DECODE_GROUPS)
    return FitReport(
        num_steps=len(measured), mape=float(ape.mean()), p90_ape=float(np.percentile(ape, 90)),
        r2=1 - ss_res / ss_tot if ss_tot > 0 else math.nan, total_error=float(predicted.sum() / measured.sum() - 1),
        by_kind=group_errors([s.kind for s in shapes], STEP_KINDS, predicted, measured),
        decode_by_seqs=group_errors([decode_group(shapes[i].seqs) for i in decodes], decode_labels,
                                    predicted[decodes], measured[decodes]),
    )  # fmt: skip


def nnls(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """min |a x - b| subject to x >= 0: Lawson and Hanson's active-set method (numpy only, no scipy in the
    environment). A coefficient is freed while the residual's gradient says it would help; a least-squares step that
    would take a free one below 0 stops where the first reaches 0, and that one is held at 0 again."""
    n = a.shape[1]
    x, free = np.zeros(n), np.zeros(n, dtype=bool)
    tol = 1e-12 * np.linalg.norm(a) * np.linalg.norm(b)
    for _ in range(3 * n):
        gain = a.T @ (b - a @ x)
        if free.all() or gain[~free].max() <= tol:
            break
        free[np.argmax(np.where(free, -np.inf, gain))] = True
        while free.any():
            z = np.zeros(n)
            z[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (z[free] > 0).all():
                x = z
                break
            crossing = np.flatnonzero(free & (z <= 0))
            steps = x[crossing] / (x[crossing] - z[crossing])
            x = x + steps.min() * (z - x)
            x[crossing[np.argmin(steps)]] = 0.0
            free &= x > 0
    return x


def fit_linear(
    shapes: list[StepShape], seconds: list[float], knots: tuple[int, ...] = KNOTS, folds: int = 5
) -> tuple[LinearStepModel, FitReport]:
    """Fit on all steps; report the error of each step predicted by the fit on the other folds (every fifth step
    is one fold). Rows are weighted by 1/seconds so the fit minimises relative error (short decode steps count as
    much as long prefills). Steps a first fit misses by far more than the rest (a one-off stall: a new GEMM shape's
    set-up, the host busy elsewhere) are left out of the second fit; the held-out error still counts them."""
    x = np.array([features(s, knots) for s in shapes], dtype=float)
    y = np.array(seconds, dtype=float)
    scale = x.max(axis=0)
    scale[scale == 0] = 1.0

    def solve_once(mask: np.ndarray) -> np.ndarray:
        w = 1.0 / y[mask]
        return nnls(x[mask] / scale * w[:, None], y[mask] * w) / scale

    def solve(mask: np.ndarray) -> np.ndarray:
        coef = solve_once(mask)
        rel = np.abs(x @ coef - y) / y
        keep = mask & (rel <= max(0.5, 5 * float(np.median(rel[mask]))))
        return solve_once(keep) if keep.sum() >= x.shape[1] else coef

    coef = solve(np.ones(len(y), dtype=bool))
    predicted, fold = x @ coef, np.arange(len(y)) % folds  # in-sample where too few steps are left without a fold
    if len(y) - (fold == 0).sum() >= x.shape[1]:
        for k in range(folds):
            predicted[fold == k] = x[fold == k] @ solve(fold != k)
    model = LinearStepModel({n: float(c) for n, c in zip(feature_names(knots), coef, strict=True)}, knots)
    return model, error_report(shapes, predicted, y)


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


@dataclass
class ScaledStepModel:
    """Another model's step times x `factor` (decode-only steps x `decode_factor` when given): the host runs that many
    times as slow as when the profile was taken. A shared machine drifts by 10-30% between minutes, and not evenly:
    decodes, which stream the weights and the K/V from memory, move with the memory's load, prefills, which compute,
    much less (`batchserve profile --check` measures both)."""

    inner: StepTimeModel
    factor: float
    decode_factor: float | None = None

    @property
    def kind(self) -> str:
        return self.inner.kind

    def scale_of(self, shape: StepShape) -> float:
        return self.decode_factor if self.decode_factor is not None and shape.kind == "decode" else self.factor

    def predict(self, shape: StepShape) -> float:
        return self.inner.predict(shape) * self.scale_of(shape)

    def describe(self) -> str:
        decodes = "" if self.decode_factor is None else f", decode steps x {self.decode_factor:g}"
        return f"step times x {self.factor:g}{decodes}"

    def to_dict(self) -> dict[str, Any]:
        scales = {"time_scale": self.factor, "decode_time_scale": self.decode_factor}
        return {**self.inner.to_dict(), **{k: v for k, v in scales.items() if v is not None}}


def model_from_dict(d: dict[str, Any]) -> StepTimeModel:
    if "time_scale" in d:
        inner = model_from_dict({k: v for k, v in d.items() if k not in ("time_scale", "decode_time_scale")})
        decode = d.get("decode_time_scale")
        return ScaledStepModel(inner, float(d["time_scale"]), None if decode is None else float(decode))
    kind = d.get("kind")
    if kind == "linear":
        return LinearStepModel(dict(d["coefficients"]), tuple(d.get("knots", ())))
    if kind == "roofline":
        return RooflineStepModel(**{k: v for k, v in d.items()})
    raise ValueError(f"unknown step-time model kind {kind!r} (linear, roofline)")
