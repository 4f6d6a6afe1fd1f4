"""The piecewise-linear step-time model (knots in the token count), old profiles without knots, and the fit."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
import pytest

from batchserve.simulator.profile_file import Profile
from batchserve.simulator.shape import FEATURES, StepShape
from batchserve.simulator.step_model import KNOTS, LinearStepModel, features, fit_linear, model_from_dict, nnls

PROFILE_DIR = Path(__file__).parents[2] / "benchmarks" / "profiles"
# measured before the step model had knots and the per-chunk and mixed-step terms
PROFILES = [
    PROFILE_DIR / f"smollm2-bf16-1thread-{name}.json" for name in ("epyc-2cpu", "epyc-2cpu-padded", "xeon-2cpu")
]


def test_piecewise_model_reproduces_a_hand_computed_step_time():
    coefficients = {"steps": 0.02, "tokens": 1e-5, "seqs": 1e-4, "samples": 0.0, "decode_ctx": 2e-6,
                    "prefill_pairs": 1e-9, "tokens>8": 1e-3, "tokens>32": 5e-4, "multi_row": 4e-3}  # fmt: skip
    model = LinearStepModel(coefficients, knots=(8, 32))
    mixed = StepShape(tokens=40, seqs=3, samples=3, decode_ctx=1000, prefill_pairs=10_000)
    # 20 ms + 40 x 10 us + 3 x 100 us + 1000 x 2 us + 10^4 x 1 ns + (40 - 8) x 1 ms + (40 - 32) x 0.5 ms + 4 ms
    assert model.predict(mixed) == pytest.approx(0.02 + 0.0004 + 0.0003 + 0.002 + 0.00001 + 0.032 + 0.004 + 0.004)
    decode = StepShape(tokens=4, seqs=4, samples=4, decode_ctx=100)  # below the first knot: no extra cost
    assert model.predict(decode) == pytest.approx(0.02 + 4e-5 + 4e-4 + 2e-4 + 0.004)
    one_row = StepShape(tokens=1, seqs=1, samples=1, decode_ctx=100)  # a matrix-vector step: no multi-row cost
    assert model.predict(one_row) == pytest.approx(0.02 + 1e-5 + 1e-4 + 2e-4)
    assert model.token_slopes() == [(0, 1e-5), (8, pytest.approx(1.01e-3)), (32, pytest.approx(1.51e-3))]
    back = model_from_dict(model.to_dict())
    assert back.knots == (8, 32) and back.predict(mixed) == model.predict(mixed)


@pytest.mark.parametrize("path", PROFILES, ids=lambda p: p.name)
def test_old_profiles_load_and_predict_exactly_as_before(path):
    profile = Profile.load(path)
    model, coefficients = profile.step_model, profile.step_model.coefficients
    added_since = {"prefill_seqs", "mixed", "decode_ctx_distinct", "multi_row"}
    assert model.knots == () and set(coefficients) == set(FEATURES) - added_since
    fields = profile.notes["step_fields"][:-1]
    for row in profile.notes["steps"]:
        shape = StepShape(**dict(zip(fields, row, strict=False)))
        before = sum(coefficients.get(name, 0.0) * v for name, v in zip(FEATURES, shape.features(), strict=True))
        assert model.predict(shape) == before


def synthetic_steps(truth: LinearStepModel, n: int, noise: float, seed: int = 0) -> tuple[list[StepShape], list[float]]:
    """Decodes of 1-64 sequences and prefill chunks of 16-2048 tokens (some with decodes), as a profile's grid."""
    rng = random.Random(seed)
    shapes, seconds = [], []
    for _ in range(n):
        seqs = rng.choice([1, 2, 3, 4, 8, 16, 32, 64])
        chunk = rng.choice([0, 0, 0, rng.randint(16, 2048)])
        s = StepShape(tokens=seqs + chunk, seqs=seqs + (chunk > 0), samples=rng.randint(1, seqs), decode_ctx=seqs * rng.randint(32, 2048),
                      prefill_pairs=chunk * (chunk + 1) // 2)  # fmt: skip
        shapes.append(s)
        seconds.append(truth.predict(s) * rng.uniform(1 - noise, 1 + noise))
    return shapes, seconds


def test_fit_recovers_known_piecewise_coefficients():
    # a GEMM flat for the first 8 rows, then 1 ms a row, 1.5 ms past 128 rows; 1% noise
    truth = LinearStepModel({"steps": 0.025, "tokens": 0.0, "seqs": 1e-4, "samples": 0.0, "decode_ctx": 2e-6,
                             "prefill_pairs": 2e-7, "tokens>8": 1e-3, "tokens>128": 5e-4}, knots=KNOTS)  # fmt: skip
    shapes, seconds = synthetic_steps(truth, 500, noise=0.01)
    model, report = fit_linear(shapes, seconds)
    assert model.knots == KNOTS
    for name in ("steps", "seqs", "decode_ctx", "prefill_pairs", "tokens>8", "tokens>128"):
        assert model.coefficients[name] == pytest.approx(truth.coefficients[name], rel=0.1), name
    for name in ("tokens", "samples", "tokens>32", "tokens>512"):  # terms the truth lacks: under 0.5% of any step
        i = model.names.index(name)
        assert max(model.coefficients[name] * features(s, KNOTS)[i] / truth.predict(s) for s in shapes) < 0.005, name
    assert report.mape < 0.01 and report.decode_by_seqs["1"]["mape"] < 0.01
    # the plain linear model cannot bend: its one- and two-sequence decodes are off by far more than the noise
    _, linear = fit_linear(shapes, seconds, knots=())
    assert abs(linear.decode_by_seqs["1"]["bias"]) > 0.05 and linear.mape > 2 * report.mape


def test_nnls_finds_the_best_non_negative_solution():
    """Against every support set on small random problems with correlated columns, as hinge features are (where
    dropping the most negative coefficient until none is ends at a worse solution about a third of the time)."""
    rng = np.random.default_rng(0)
    for _ in range(50):
        a, b = rng.normal(size=(16, 6)) @ rng.normal(size=(6, 6)), rng.normal(size=16)
        best = np.inf
        for k in range(7):
            for support in itertools.combinations(range(6), k):
                x = np.zeros(6)
                if support:
                    x[list(support)] = np.linalg.lstsq(a[:, support], b, rcond=None)[0]
                if (x >= 0).all():
                    best = min(best, float(np.linalg.norm(a @ x - b)))
        x = nnls(a, b)
        assert (x >= 0).all() and np.linalg.norm(a @ x - b) == pytest.approx(best, rel=1e-9)


def test_current_profile_predicts_its_own_steps():
    # The AMX Xeon profile, fitted with knots and every feature: its recorded steps predicted within its held-out error.
    profile = Profile.load(PROFILE_DIR / "smollm2-bf16-1thread-xeon-amx-2cpu.json")
    model = profile.step_model
    assert model.knots == KNOTS and {"prefill_seqs", "mixed"} <= set(model.coefficients)
    fields = profile.notes["step_fields"][:-1]
    shapes = [StepShape(**dict(zip(fields, row[:-1], strict=True))) for row in profile.notes["steps"]]
    errors = [abs(model.predict(s) / row[-1] - 1) for s, row in zip(shapes, profile.notes["steps"], strict=True)]
    assert sum(errors) / len(errors) < profile.fit["mape"] and any(s.prefill_seqs for s in shapes)
