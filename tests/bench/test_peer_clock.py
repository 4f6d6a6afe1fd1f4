"""benchmarks/peer_compare.py's CPU clock (the CPU seconds of an engine's processes, children included, rate it) and
roofline.py's step roofline (per step the larger of its matmul time and its bytes at the bandwidth)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import time
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def benchmark():
    sys.path.insert(0, str(BENCHMARKS))
    try:
        yield importlib.import_module
    finally:
        sys.path.remove(str(BENCHMARKS))


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="reads /proc")
def test_the_cpu_clock_counts_a_child_process_s_seconds(benchmark):
    peer = benchmark("peer_compare")
    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.3: pass\ninput()"
    with peer.Timed() as timed:
        child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 120  # a loaded host may give the child its 0.3 s slowly
        while peer._tree_cpu_s() - timed.cpu0 < 0.3 and time.monotonic() < deadline:
            time.sleep(0.01)  # the child still runs: its seconds are read from /proc, not from a wait()
    child.communicate("\n")
    assert timed.cpu_s >= 0.3 and timed.seconds() == {"wall_s": timed.wall_s, "cpu_s": timed.cpu_s}


def test_the_table_rates_engines_by_the_clock_asked_for(benchmark):
    peer = benchmark("peer_compare")
    common = dict(num_requests=2, prompt_tokens=10, output_tokens=100, load_s=1.0, loadavg_1min_start_end=[1, 1])
    results = [dict(engine="batchserve", wall_s=10.0, cpu_s=5.0, **common),
               dict(engine="vllm", wall_s=10.0, cpu_s=10.0, **common)]  # fmt: skip
    peer.table(results, "cpu")
    assert results[0]["output_tok_s"] == 20.0 and results[1]["ratio_output_vs_batchserve"] == 0.5
    peer.table(results, "wall")
    assert results[1]["ratio_output_vs_batchserve"] == 1.0
    lines = peer.table([dict(results[0], cpu_s=None)], "cpu")
    assert "no cpu seconds reported" in lines[-1]


def _rows(shapes_s: dict[int, float]) -> list[dict]:
    roofline_names = ("qkv", "o", "gate_up", "down", "lm_head")
    return [{"dtype": "float32", "M": m, "matmul_s": dict.fromkeys(roofline_names, s)} for m, s in shapes_s.items()]


def test_matmul_time_is_linear_between_the_measured_rows(benchmark):
    roofline = benchmark("roofline")
    mine = {r["M"]: r for r in _rows({2: 1.0, 8: 2.5})}
    assert roofline._matmul_s(mine, "qkv", 0) == 0.0
    assert roofline._matmul_s(mine, "qkv", 1) == pytest.approx(0.5)  # toward zero rows
    assert roofline._matmul_s(mine, "qkv", 5) == pytest.approx(1.75)
    assert roofline._matmul_s(mine, "qkv", 16) == pytest.approx(5.0)  # past the largest: its per-row rate


def test_each_step_takes_the_larger_of_its_matmuls_and_its_bytes(benchmark):
    roofline = benchmark("roofline")
    rows = _rows({1: 1e-4, 64: 1e-3})
    layers = roofline.LAYERS * 4
    weights = roofline.params_per_token() * 4  # float32
    bandwidth = weights / 0.01  # the weights alone: 10 ms a step
    per_kv_token = roofline.kv_bytes_per_token(4) / bandwidth
    steps = [(64, 64, 0), (1, 1, 50_000)]  # many rows, no context; one row, a long context
    bound = roofline.step_roofline(rows, "float32", steps, bandwidth)
    matmul_big = (layers + 1) * 1e-3
    assert matmul_big > 0.01  # the first step is matmul-bound, the second bandwidth-bound
    assert bound["bound_s"] == pytest.approx(matmul_big + 0.01 + 50_000 * per_kv_token)
    assert bound["compute_bound_steps"] == 1 and bound["steps"] == 2


def test_the_cpu_clock_rates_two_threads_only_when_waiting_threads_sleep():
    from batchserve.bench.machine import clock_refusal as refusal

    assert refusal("cpu", 1, "") is None and refusal("wall", 2, "") is None
    assert refusal("cpu", 2, "PASSIVE") is None
    assert "OMP_WAIT_POLICY=passive" in refusal("cpu", 2, "") and refusal("cpu", 2, "active")
