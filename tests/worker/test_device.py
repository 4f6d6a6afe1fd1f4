"""dtype "auto": bfloat16 exactly where the CPU multiplies it natively, float32 elsewhere; the engine reports it."""

from __future__ import annotations

import pytest
import torch

from batchserve.config import ConfigError, EngineConfig
from batchserve.layers import kernels
from batchserve.worker.device import resolve_dtype


@pytest.mark.parametrize(("units", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_dtype_follows_the_cpus_bf16_units(monkeypatch, units, expected):
    monkeypatch.setattr(kernels, "has_matmul_units", lambda dtype: units and dtype == torch.bfloat16)
    assert resolve_dtype("auto", torch.device("cpu")) == expected
    assert resolve_dtype("float32") == torch.float32 and resolve_dtype("bf16") == torch.bfloat16


def test_auto_is_the_default_and_unknown_dtypes_are_refused():
    assert EngineConfig().dtype == "auto"
    with pytest.raises(ConfigError, match="dtype"):
        resolve_dtype("int8")
    with pytest.raises(ConfigError, match="dtype"):
        EngineConfig.from_options(dtype="double")


def test_cpu_flags_decide_the_units(monkeypatch):
    monkeypatch.setattr(kernels, "cpu_flags", lambda: "flags : fpu avx512f avx512_bf16")
    assert kernels.has_matmul_units(torch.bfloat16) and not kernels.has_matmul_units(torch.float16)
    monkeypatch.setattr(kernels, "cpu_flags", lambda: "flags : fpu avx2 avx512f")
    assert not kernels.has_matmul_units(torch.bfloat16)


@pytest.mark.parametrize(("value", "units"), [("1", True), ("0", False)])
def test_the_units_can_be_forced_to_run_either_path(monkeypatch, value, units):
    monkeypatch.setenv("BATCHSERVE_LOW_PRECISION_UNITS", value)
    assert kernels.has_matmul_units(torch.bfloat16) is units and not kernels.has_matmul_units(torch.float32)
    assert resolve_dtype("auto") == (torch.bfloat16 if units else torch.float32)
