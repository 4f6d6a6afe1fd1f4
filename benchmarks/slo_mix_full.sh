#!/usr/bin/env bash
# The SLO mix's whole comparison for a quiet host (docs/slo.md): a fresh 1-thread profile taken with the mix's token
# budget (its prefill grid then reaches the 2,000-8,000-token steps FCFS runs; the stored profile's stops at 2,048),
# then 200 requests, every policy on the simulator and on the real engine (1 thread, as the profile), the simulator's
# goodput error per policy, then the same trace through vLLM's CPU build (bench_results/vllm-venv,
# docs/BENCHMARKS.md). About 35-40 minutes on the 2-core AMX Xeon: the profile ~2 min, 4 engine runs of ~5 min,
# vLLM's start-up (3-6 min, less once its compile cache is warm) and its run of ~5 min.
#   bash benchmarks/slo_mix_full.sh                      # from the repo root
#   PROFILE=benchmarks/profiles/smollm2-bf16-1thread-xeon-amx-2cpu-v2.json bash benchmarks/slo_mix_full.sh   # no new profile
#   bash benchmarks/slo_mix_full.sh --vllm-options '{"scheduling_policy": "priority"}'   # more slo_mix.py flags
# Writes bench_results/slo_mix-full-<time>.{json,log} (and the profile beside them). Start it when the 1-minute load
# average is well under 1, and discard a run whose load averages (printed per run) climb above ~1.5; on a host that
# stays busy, add --cpu-clock (and profile with --cpu-clock: CLOCK=--cpu-clock).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-.venv/bin/python}
stamp=$(date +%Y%m%d-%H%M%S)
mkdir -p bench_results
echo "1-minute load average before: $(cut -d' ' -f1 /proc/loadavg)"
profile=${PROFILE:-bench_results/slo_mix-profile-$stamp.json}
if [ ! -f "$profile" ]; then
  nice -n 10 "$python" -m batchserve.simulator.profiler --num-threads 1 --dtype bfloat16 --max-batch-size 64 \
    --max-num-tokens 8192 --no-progress --output "$profile" ${CLOCK:-}
fi
nice -n 10 "$python" benchmarks/slo_mix.py --profile "$profile" --requests 200 --threads 1 --engine --calibrate --vllm \
  --json "bench_results/slo_mix-full-$stamp.json" "$@" 2>&1 | grep -v Warning | tee "bench_results/slo_mix-full-$stamp.log"
