"""A step-time profile on disk: the model of a step's duration plus what the simulator needs to size the engine as
the real one would (KV bytes, context), and where it came from (machine, model, dtype; measured or an estimate)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from batchserve.simulator.step_model import ScaledStepModel, StepTimeModel, model_from_dict

FORMAT = "batchserve-step-profile/1"


@dataclass
class Profile:
    source: str  # "measured" (batchserve profile on this machine) or "analytic" (a roofline ESTIMATE)
    step_model: StepTimeModel
    model: str  # the model's name or path
    dtype: str
    kv_bytes_per_token: int  # K and V of one position over all layers, at the profile's dtype
    kv_cache_bytes: int  # the pool the engine would allocate by default (memory left after the weights x fraction)
    max_model_len: int  # the model's context
    memory_free_bytes: int = 0  # memory left after the weights: what kv_cache_memory_fraction is a share of
    machine: dict[str, Any] = field(default_factory=dict)  # machine_info(), or the device preset
    fit: dict[str, Any] = field(default_factory=dict)  # measured: the fit's error on held-out steps
    notes: dict[str, Any] = field(default_factory=dict)

    @property
    def label(self) -> str:
        where = self.machine.get("cpu") or self.machine.get("name") or "?"
        tag = "measured" if self.source == "measured" else "ESTIMATE (roofline)"
        label = f"{Path(self.model).name} {self.dtype} on {where}, {tag}"
        if isinstance(self.step_model, ScaledStepModel):  # simulate --time-scale
            label += f", {self.step_model.describe()}"
        if "parallel" in self.notes:  # simulate --tensor-parallel-size / --pipeline-parallel-size
            label += f", {self.notes['parallel']}"
        return label

    def num_kv_blocks(self, block_size: int, fraction: float | None = None) -> int:
        """The pool for this block size from the bytes the engine would give it: the default pool, or `fraction`
        of the memory left after the weights (as worker/kv_cache.py sizes it)."""
        budget = (
            self.kv_cache_bytes if fraction is None or not self.memory_free_bytes else self.memory_free_bytes * fraction
        )
        return max(1, int(budget) // (self.kv_bytes_per_token * block_size))

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "source": self.source, "model": self.model, "dtype": self.dtype,
            "kv_bytes_per_token": self.kv_bytes_per_token, "kv_cache_bytes": self.kv_cache_bytes,
            "max_model_len": self.max_model_len, "memory_free_bytes": self.memory_free_bytes, "machine": self.machine, "fit": self.fit, "notes": self.notes,
            "step_model": self.step_model.to_dict(),
        }  # fmt: skip

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")
        return path

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Profile:
        if d.get("format") != FORMAT:
            raise ValueError(f"not a step profile (format {d.get('format')!r}, expected {FORMAT!r})")
        keys = ("source", "model", "dtype", "kv_bytes_per_token", "kv_cache_bytes", "max_model_len")
        return cls(
            step_model=model_from_dict(d["step_model"]), machine=d.get("machine", {}), fit=d.get("fit", {}),
            notes=d.get("notes", {}), memory_free_bytes=d.get("memory_free_bytes", 0), **{k: d[k] for k in keys},
        )  # fmt: skip

    @classmethod
    def load(cls, path: str | Path) -> Profile:
        try:
            return cls.from_dict(json.loads(Path(path).read_text()))
        except (OSError, json.JSONDecodeError, KeyError) as exc:
            raise ValueError(f"cannot read profile {path}: {exc}") from exc
