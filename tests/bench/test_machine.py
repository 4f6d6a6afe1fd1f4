"""What every benchmark result records about the machine it ran on."""

from __future__ import annotations

from batchserve.bench.machine import PATH_FLAGS, describe, machine_info


def test_the_machine_record_names_the_paths_and_what_was_forced(monkeypatch):
    monkeypatch.delenv("BATCHSERVE_GEMM_PATH", raising=False)
    info = machine_info(threads=2, dtype="bfloat16")
    assert set(info["cpu_flags"]) <= set(PATH_FLAGS) and info["gemm_path"] == "auto"
    line = describe(info)
    assert "2 threads" in line and "bfloat16" in line and "forced" not in line
    monkeypatch.setenv("BATCHSERVE_GEMM_PATH", "onednn")
    assert describe(machine_info(threads=2, dtype="bfloat16")).endswith("bf16 GEMM forced: onednn")
