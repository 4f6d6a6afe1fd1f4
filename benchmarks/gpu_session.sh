#!/usr/bin/env bash
# The GPU session of issue 50 in two commands (docs/gpu.md):
#   bash benchmarks/gpu_session.sh prepare   # here, in the repo root: wheels of what the engine imports that a CUDA
#                                            # image with torch, transformers and triton lacks, into .whl/ (git-ignored
#                                            # through .git/info/exclude)
#   bash benchmarks/gpu_session.sh run       # there, with .whl carried: install them aside, run benchmarks/gpu_check.py
# Python 3.12 wheels for x86-64 Linux; versions pinned to what this checkout's venv runs.
set -euo pipefail
WHEELS=(xgrammar==0.2.9 apache-tvm-ffi==0.1.15.post2 pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0
        typing-inspection==0.4.5 typing_extensions==4.16.0)

case "${1:-}" in
  prepare)
    mkdir -p .git/info
    grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64 -d .whl "${WHEELS[@]}"
    du -sh .whl
    ;;
  run)
    mkdir -p "${OUT:-bench_results}"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target bench_results/gpu-site .whl/*.whl
    export PYTHONPATH="$PWD/bench_results/gpu-site:$PWD" PYTHONUNBUFFERED=1 BATCHSERVE_NATIVE_KERNELS=0
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
    python3 benchmarks/gpu_check.py --out "${OUT:-bench_results}" "${@:2}" 2>&1 | tee "${OUT:-bench_results}/gpu_check.log"
    ;;
  *)
    echo "usage: $0 prepare|run [gpu_check.py options]" >&2
    exit 2
    ;;
esac
