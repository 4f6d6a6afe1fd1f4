"""What LoRA adapters add to a step's time: each group of rows with one adapter runs, on every target projection of
every layer, a shrink (rows x in_features x rank) and an expand (rows x rank x out_features), and reads that
adapter's A and B once. So the extra cost is a time per adapter row, from the adapter's FLOPs, and a time per
adapter in the step, from its bytes.

The rates come from the base step model, not a profile of its own: a roofline's achievable FLOP rate and bandwidth,
or for a fitted (linear) profile, the share of the base projections' FLOPs (and weight bytes) the adapter adds
times the profile's per-token slope where it is compute bound (its last piece), and the time of a one-token step,
which streams every weight once. An estimate: the small rank-wide GEMMs run below the base GEMMs' rate, so it errs
low; `benchmarks/lora.py` measures the real ratio."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from batchserve.config import ModelConfig
from batchserve.simulator.shape import StepShape
from batchserve.simulator.step_model import LinearStepModel, RooflineStepModel, ScaledStepModel, StepTimeModel

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class LoRAShape:
    """An adapter's size on a base model: its rank and the projections it targets."""

    rank: int
    targets: tuple[str, ...] = ALL_TARGETS

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora rank must be at least 1, got {self.rank}")
        unknown = sorted(set(self.targets) - set(ALL_TARGETS))
        if unknown or not self.targets:
            raise ValueError(f"lora targets must be among {', '.join(ALL_TARGETS)}, got {list(self.targets)}")

    def params(self, config: ModelConfig) -> int:
        """A and B of every target projection, all layers: rank x (in + out) each."""
        sizes = projection_shapes(config)
        return config.num_layers * self.rank * sum(sum(sizes[t]) for t in self.targets)


def projection_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of each target projection: the shapes the serving path fits adapters to."""
    from batchserve.models.lora_adapters import target_shapes  # imports torch: only when adapters are priced

    return target_shapes(config)


def base_projection_params(config: ModelConfig) -> int:
    return config.num_layers * sum(o * i for o, i in projection_shapes(config).values())


@dataclass
class LoRAStepModel:
    """The base model's step time plus `seconds_per_token` for each adapter row and `seconds_per_adapter` for each
    distinct adapter in the step (StepShape.lora_tokens, lora_groups)."""

    inner: StepTimeModel
    seconds_per_token: float
    seconds_per_adapter: float

    @property
    def kind(self) -> str:
        return self.inner.kind

    def predict(self, shape: StepShape) -> float:
        extra = self.seconds_per_token * shape.lora_tokens + self.seconds_per_adapter * shape.lora_groups
        return self.inner.predict(shape) + extra

    def to_dict(self) -> dict[str, Any]:
        return self.inner.to_dict()  # a profile file keeps the base model; the adapters are the run's


def lora_step_model(
    inner: StepTimeModel, config: ModelConfig, lora: LoRAShape, dtype: str = "bfloat16"
) -> LoRAStepModel:
    """`inner` with the cost of adapters shaped `lora` on the base `config` (module docstring: where the rates come
    from). A ScaledStepModel's factor scales the adapters' cost too."""
    factor, base = 1.0, inner
    if isinstance(base, ScaledStepModel):
        factor, base = base.factor, base.inner
    params = lora.params(config)
    if isinstance(base, RooflineStepModel):
        per_token = 2.0 * params / base.peak_flops
        per_adapter = params * DTYPE_BYTES.get(dtype, 2) / base.bandwidth
    elif isinstance(base, LinearStepModel):
        share = params / base_projection_params(config)
        per_token = share * base.token_slopes()[-1][1]
        one_token = base.coefficients.get("steps", 0.0) + base.token_slopes()[0][1]
        per_adapter = share * one_token
    else:
        raise ValueError(f"the LoRA cost needs a linear or roofline step model, not {base.kind!r}")
    return LoRAStepModel(inner, factor * per_token, factor * per_adapter)
