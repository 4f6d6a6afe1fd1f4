"""dtype "auto": bfloat16 exactly where the CPU multiplies it natively, float32 elsewhere; the engine reports it.
OpenMP workers of a thread that no longer steps the engine are let go; memory a step frees stays mapped."""

from __future__ import annotations

import asyncio
import os
import random
import resource
import threading
import time

import pytest
import torch

from batchserve.config import ConfigError, EngineConfig
from batchserve.engine.async_engine import AsyncLLMEngine
from batchserve.engine.llm_engine import LLMEngine
from batchserve.host.process import keep_freed_memory, openmp_runtime, release_openmp_workers
from batchserve.layers import kernels
from batchserve.sampling_params import SamplingParams
from batchserve.worker.device import resolve_dtype
from tests.server.fakes import fake_engine


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


def _os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in /proc")
def test_a_thread_that_built_the_model_lets_its_openmp_workers_go():
    """The thread that built an engine ends its OpenMP team when the engine loop takes over; otherwise, with more
    OpenMP threads than cores, every team's workers sleep after each region (the engine loop pays a wake-up per
    operator)."""
    counts: dict[str, int] = {}

    def builder() -> None:
        torch.set_num_threads(2)
        a = torch.randn(512, 512)
        _ = a @ a  # a parallel region: this thread's team of workers starts
        counts["with team"] = _os_threads()
        counts["released"] = int(release_openmp_workers())
        deadline = time.monotonic() + 5
        while _os_threads() >= counts["with team"] and time.monotonic() < deadline:
            time.sleep(0.01)
        counts["after"] = _os_threads()

    threads = torch.get_num_threads()
    try:
        worker = threading.Thread(target=builder)
        worker.start()
        worker.join()
    finally:
        torch.set_num_threads(threads)
    assert counts["released"] == 1, "torch's OpenMP runtime has no omp_pause_resource_all"
    assert counts["after"] < counts["with team"], counts


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs OpenMP's default (the core count) to differ from 1")
def test_the_engine_loop_runs_openmp_regions_with_torchs_thread_count():
    """torch.set_num_threads holds for the thread that called it; the engine loop thread gets the same count, not
    OpenMP's process default (what Ray's OMP_NUM_THREADS or the core count would give oneDNN's GEMMs)."""
    runtime = openmp_runtime()
    assert runtime is not None
    seen: list[int] = []
    engine = fake_engine(delay_s=0.0)
    execute = engine.runner.execute
    engine.runner.execute = lambda out: seen.append(runtime.omp_get_max_threads()) or execute(out)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        async_engine = AsyncLLMEngine(engine).start()

        async def generate() -> None:
            async for _ in async_engine.generate([1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True)):
                pass

        asyncio.run(generate())
        async_engine.shutdown()
    finally:
        torch.set_num_threads(threads)
    assert seen and set(seen) == {1}, seen


@pytest.mark.slow
@pytest.mark.skipif(not hasattr(resource, "RUSAGE_SELF"), reason="counts page faults")
def test_prefill_steps_reuse_the_memory_the_last_one_freed():
    """Prefill steps of 1,024 tokens on the default model (float32, the path every CPU runs): once the heap keeps
    freed memory, a step after the first two page-faults almost nothing in; with glibc's defaults each one faulted
    27,000-99,000 pages (zero-filled by the kernel) of activations the step before had handed back."""
    if not keep_freed_memory():
        pytest.skip("not glibc: its mallopt settings do not apply")
    engine = LLMEngine.from_options(
        dtype="float32", num_kv_blocks=512, max_num_tokens=1024, enable_prefix_caching=False
    )
    rng = random.Random(0)
    faults = []
    for step in range(4):  # the first two fill the heap; the two after are what is measured
        for i in range(8):
            prompt = [rng.randrange(100, 40_000) for _ in range(128)]
            engine.add_prompt(f"{step}-{i}", prompt, SamplingParams(max_tokens=1))
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        engine.step()
        assert engine.last_stats.num_prefill_tokens == 1024
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        while engine.has_unfinished_requests():
            engine.step()
    assert max(faults[2:]) < 8192, faults  # 32 MiB; the step's activations are several times that
