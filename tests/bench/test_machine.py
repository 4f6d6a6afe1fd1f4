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


def test_the_cpu_model_number_is_named_apart_from_the_model_name(tmp_path, monkeypatch):
    from batchserve.bench import machine

    cpuinfo = "processor\t: 0\ncpu family\t: 6\nmodel\t\t: 167\nmodel name\t: Some Xeon\nflags\t\t: avx2 amx_bf16\n"
    monkeypatch.setattr(machine, "Path", lambda _: type("P", (), {"read_text": lambda self: cpuinfo})())
    info = machine_info(threads=1)
    assert (info["cpu"], info["cpu_family"], info["cpu_model"]) == ("Some Xeon", "6", "167")
    assert describe(info).startswith("Some Xeon (family 6 model 167, ")
