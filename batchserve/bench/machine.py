"""What a speed figure was measured on: CPU model and family, the flags that pick code paths, threads and dtype.
Every benchmark result records it and every table prints it (standard library only: benchmark workers import it in
any venv)."""

from __future__ import annotations

import os
import platform
from pathlib import Path
from typing import Any

# The flags that decide the code paths (AVX-512 kernels, bf16/fp16 GEMM units).
PATH_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")


def _cpuinfo_field(lines: list[str], name: str) -> str | None:
    # the key whole: "model" must not match "model name"
    line = next((x for x in lines if x.split(":", 1)[0].strip() == name), None)
    return line.split(":", 1)[1].strip() if line else None


def machine_info(threads: int | None = None, dtype: str | None = None) -> dict[str, Any]:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        lines = []
    flags = set((_cpuinfo_field(lines, "flags") or "").split())
    return {
        "cpu": _cpuinfo_field(lines, "model name") or platform.processor() or platform.machine(),
        "cpu_family": _cpuinfo_field(lines, "cpu family"),
        "cpu_model": _cpuinfo_field(lines, "model"),
        "cpu_flags": [f for f in PATH_FLAGS if f in flags],
        "bf16_units": bool(flags & {"avx512_bf16", "amx_bf16"}),
        "cpu_count": os.cpu_count(),
        "threads": threads,
        "dtype": dtype,
        "load_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        # a forced bf16 GEMM path (auto: AMX where amx_bf16 is in the flags, else oneDNN)
        "gemm_path": os.environ.get("BATCHSERVE_GEMM_PATH") or "auto",
    }


def _model(info: dict[str, Any]) -> str:
    return f" model {info['cpu_model']}" if info.get("cpu_model") else ""  # records from before it was kept lack it


def describe(info: dict[str, Any]) -> str:
    """One line for a table's header."""
    parts = [
        f"{info['cpu']} (family {info['cpu_family']}{_model(info)}, {info['cpu_count']} CPUs)",
        f"flags: {' '.join(info['cpu_flags']) or 'none of ' + '/'.join(PATH_FLAGS)}",
        f"bf16 units: {'yes' if info['bf16_units'] else 'no'}",
    ]
    if info.get("threads") is not None:
        parts.append(f"{info['threads']} threads")
    if info.get("dtype"):
        parts.append(str(info["dtype"]))
    if info.get("gemm_path", "auto") != "auto":
        parts.append(f"bf16 GEMM forced: {info['gemm_path']}")
    return "; ".join(parts)


def clock_refusal(clock: str, threads: int, wait_policy: str) -> str | None:
    """Why `clock` cannot rate engines on `threads` threads under OpenMP's wait policy `wait_policy`; None if it can.
    Threads that spin while they wait count their waits as CPU seconds, and on a loaded host they spin on while the
    thread they wait for is preempted: the CPU clock rates more than one thread only when waiting threads sleep."""
    if clock != "cpu" or threads == 1 or wait_policy.lower() == "passive":
        return None
    return "--clock cpu: use it with --threads 1, or with OMP_WAIT_POLICY=passive (waiting threads that spin count their waits)"
