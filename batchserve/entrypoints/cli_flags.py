"""The flags each `batchserve` command takes, written out, so that a flag it does not take is answered before the
command's module is imported (torch, FastAPI: seconds). tests/test_cli.py checks this table against the parsers;
`python -m batchserve.entrypoints.cli_flags` rewrites it after a flag is added."""

from __future__ import annotations

import sys
from pathlib import Path

# command -> the modules whose parser reads its flags ("module:function"); serve and tune have two
PARSERS: dict[str, tuple[str, ...]] = {
    "generate": ("batchserve.entrypoints.generate:build_generate_parser",),
    "serve": ("batchserve.entrypoints.openai.launch:make_parser",),
    "bench": ("batchserve.bench.cli:build_parser",),
    "tune": ("batchserve.bench.tune:build_parser", "batchserve.simulator.tune_sim:build_parser"),
    "profile": ("batchserve.simulator.profiler:build_parser",),
    "simulate": ("batchserve.simulator.cli:build_parser",),
    "doctor": ("batchserve.doctor.cli:build_parser",),
}

# the generator's own layout, one wrapped line per run of flags
# fmt: off
# BEGIN GENERATED
COMMAND_FLAGS: dict[str, frozenset[str]] = {
    'generate': frozenset({
        '--allow-runtime-lora-updating', '--block-size', '--config', '--convert', '--deterministic', '--device',
        '--distributed-executor-backend', '--dtype', '--enable-chunked-prefill', '--enable-lora',
        '--enable-prefix-caching', '--enforce-eager', '--extra-llm-api-options', '--extra_llm_api_options',
        '--gpu-memory-utilization', '--help', '--json', '--kv-cache-dtype', '--kv-cache-memory-fraction',
        '--kv-offload-dir', '--kv-offload-max-bytes', '--long-prefill-token-threshold', '--lora-modules',
        '--max-batch-size', '--max-cpu-loras', '--max-input-len', '--max-long-partial-prefills', '--max-lora-rank',
        '--max-loras', '--max-model-len', '--max-num-batched-tokens', '--max-num-partial-prefills', '--max-num-seqs',
        '--max-num-tokens', '--max-preemptions-per-request', '--max-tokens', '--max-wait-s', '--max-waiting-requests',
        '--model', '--no-allow-runtime-lora-updating', '--no-deterministic', '--no-enable-chunked-prefill',
        '--no-enable-lora', '--no-enable-prefix-caching', '--no-enforce-eager', '--no-record-steps',
        '--no-static-padding', '--num-gpu-blocks-override', '--num-kv-blocks', '--num-swap-blocks', '--num-threads',
        '--pipeline-micro-batches', '--pipeline-parallel-size', '--preemption-mode', '--prefill-attention',
        '--quantization', '--raw', '--record-steps', '--request-timeout', '--runner', '--scheduler-policy',
        '--scheduling-order', '--seed', '--slo-admission', '--slo-reserved-slots', '--speculative-config',
        '--static-padding', '--swap-space', '--swap-space-gb', '--temperature', '--tensor-parallel-size',
        '--tokenizer', '--top-p', '--tpot-slo-ms', '--truncation', '--ttft-slo-ms', '-h',
    }),
    'serve': frozenset({
        '--allow-runtime-lora-updating', '--api-key', '--api-key-protects-metrics', '--block-size',
        '--body-read-timeout', '--body-timeout', '--chat-template', '--config', '--convert', '--deterministic',
        '--device', '--disable-frontend-multiprocessing', '--distributed-executor-backend', '--drain-timeout',
        '--dtype', '--enable-chunked-prefill', '--enable-lora', '--enable-prefix-caching', '--enforce-eager',
        '--error-delay-after', '--error-delay-clients', '--error-delay-max', '--extra-llm-api-options',
        '--extra_llm_api_options', '--gpu-memory-utilization', '--grpc-port', '--header-timeout', '--help', '--host',
        '--keep-alive-timeout', '--kv-cache-dtype', '--kv-cache-memory-fraction', '--kv-offload-dir',
        '--kv-offload-max-bytes', '--lenient', '--log-format', '--log-level', '--long-prefill-token-threshold',
        '--lora-modules', '--max-batch-size', '--max-body-bytes', '--max-connections', '--max-cpu-loras',
        '--max-input-len', '--max-long-partial-prefills', '--max-lora-rank', '--max-loras', '--max-model-len',
        '--max-num-batched-tokens', '--max-num-partial-prefills', '--max-num-seqs', '--max-num-tokens',
        '--max-preemptions-per-request', '--max-replicas', '--max-wait-s', '--max-waiting-requests', '--model',
        '--no-allow-runtime-lora-updating', '--no-deterministic', '--no-enable-chunked-prefill', '--no-enable-lora',
        '--no-enable-prefix-caching', '--no-enforce-eager', '--no-record-steps', '--no-static-padding',
        '--num-gpu-blocks-override', '--num-kv-blocks', '--num-swap-blocks', '--num-threads',
        '--otlp-traces-endpoint', '--pipeline-micro-batches', '--pipeline-parallel-size', '--port',
        '--preemption-mode', '--prefill-attention', '--quantization', '--ray-address', '--ray-proxy',
        '--reasoning-parser', '--record-steps', '--replica-cpus', '--replicas', '--request-timeout', '--router',
        '--runner', '--scheduler-policy', '--scheduling-order', '--seed', '--served-model-name', '--slo-admission',
        '--slo-reserved-slots', '--speculative-config', '--stall-timeout', '--static-padding', '--swap-space',
        '--swap-space-gb', '--target-ongoing-requests', '--tensor-parallel-size', '--tokenizer', '--tool-call-parser',
        '--tpot-slo-ms', '--truncation', '--ttft-slo-ms', '-h',
    }),
    'bench': frozenset({
        '--allow-runtime-lora-updating', '--api-key', '--arrival', '--backend', '--base-url', '--block-size',
        '--burstiness', '--compare-static', '--config', '--convert', '--dataset', '--dataset-name', '--dataset-path',
        '--deterministic', '--device', '--disable-tqdm', '--distributed-executor-backend', '--dtype',
        '--enable-chunked-prefill', '--enable-lora', '--enable-prefix-caching', '--endpoint', '--enforce-eager',
        '--extra-llm-api-options', '--extra_llm_api_options', '--goodput', '--gpu-memory-utilization',
        '--grpc-target', '--help', '--host', '--ignore-eos', '--input-len', '--kv-cache-dtype',
        '--kv-cache-memory-fraction', '--kv-offload-dir', '--kv-offload-max-bytes', '--long-input-len',
        '--long-output-len', '--long-prefill-token-threshold', '--long-ratio', '--lora-modules', '--max-batch-size',
        '--max-concurrency', '--max-cpu-loras', '--max-input-len', '--max-long-partial-prefills', '--max-lora-rank',
        '--max-loras', '--max-model-len', '--max-num-batched-tokens', '--max-num-partial-prefills', '--max-num-seqs',
        '--max-num-tokens', '--max-output-len', '--max-preemptions-per-request', '--max-wait-s',
        '--max-waiting-requests', '--model', '--model-name', '--no-allow-runtime-lora-updating', '--no-deterministic',
        '--no-enable-chunked-prefill', '--no-enable-lora', '--no-enable-prefix-caching', '--no-enforce-eager',
        '--no-ignore-eos', '--no-plots', '--no-progress', '--no-record-steps', '--no-save-result',
        '--no-static-padding', '--num-gpu-blocks-override', '--num-kv-blocks', '--num-prefixes', '--num-prompts',
        '--num-requests', '--num-swap-blocks', '--num-threads', '--num-warmups', '--offline', '--output-dir',
        '--output-len', '--percentile-metrics', '--pipeline-micro-batches', '--pipeline-parallel-size', '--port',
        '--preemption-mode', '--prefill-attention', '--prefix-len', '--prompt-format', '--quantization',
        '--random-input-len', '--random-output-len', '--random-range-ratio', '--record-steps', '--request-rate',
        '--request-timeout', '--result-dir', '--runner', '--save-result', '--scheduler-policy', '--scheduling-order',
        '--seed', '--served-model-name', '--sigma', '--slo-admission', '--slo-reserved-slots', '--slo-tpot-ms',
        '--slo-ttft-ms', '--speculative-config', '--spread', '--static-padding', '--swap-space', '--swap-space-gb',
        '--sweep-rates', '--tensor-parallel-size', '--timeline-steps', '--timeout', '--tokenizer', '--tpot-slo-ms',
        '--truncation', '--ttft-slo-ms', '--warmup-requests', '--workload', '-h',
    }),
    'tune': frozenset({
        '--allow-runtime-lora-updating', '--allreduce-bandwidth-gbs', '--allreduce-latency-us', '--arrival',
        '--batch-sizes', '--block-size', '--block-sizes', '--burstiness', '--chunked', '--config', '--confirm',
        '--convert', '--dataset', '--dataset-name', '--dataset-path', '--decode-time-scale', '--deterministic',
        '--device', '--device-preset', '--disable-tqdm', '--distributed-executor-backend', '--dtype',
        '--enable-chunked-prefill', '--enable-lora', '--enable-prefix-caching', '--enforce-eager',
        '--extra-llm-api-options', '--extra_llm_api_options', '--goodput', '--gpu', '--gpu-memory-utilization',
        '--help', '--host-memory-gib', '--ignore-eos', '--input-len', '--kv-cache-dtype',
        '--kv-cache-memory-fraction', '--kv-offload-blocks', '--kv-offload-dir', '--kv-offload-max-bytes',
        '--kv-offload-read-gbps', '--long-input-len', '--long-output-len', '--long-prefill-token-threshold',
        '--long-ratio', '--lora-adapters', '--lora-modules', '--lora-rank', '--lora-targets', '--max-batch-size',
        '--max-concurrency', '--max-cpu-loras', '--max-input-len', '--max-long-partial-prefills', '--max-lora-rank',
        '--max-loras', '--max-model-len', '--max-num-batched-tokens', '--max-num-partial-prefills', '--max-num-seqs',
        '--max-num-tokens', '--max-output-len', '--max-preemptions-per-request', '--max-wait-s',
        '--max-waiting-requests', '--min-attainment', '--model', '--model-shapes', '--no-allow-runtime-lora-updating',
        '--no-deterministic', '--no-enable-chunked-prefill', '--no-enable-lora', '--no-enable-prefix-caching',
        '--no-enforce-eager', '--no-ignore-eos', '--no-progress', '--no-record-steps', '--no-static-padding',
        '--num-gpu-blocks-override', '--num-kv-blocks', '--num-prefixes', '--num-prompts', '--num-requests',
        '--num-swap-blocks', '--num-threads', '--num-tokens', '--num-warmups', '--orders', '--output', '--output-len',
        '--percentile-metrics', '--pipeline-micro-batches', '--pipeline-parallel-size', '--policies',
        '--preemption-mode', '--prefill-attention', '--prefill-thresholds', '--prefix-len', '--profile',
        '--quantization', '--random-input-len', '--random-output-len', '--random-range-ratio', '--ranks-per-host',
        '--record-steps', '--replicas', '--replicas-list', '--request-rate', '--request-timeout', '--results-json',
        '--router', '--runner', '--scheduler-policy', '--scheduling-order', '--seed', '--sigma', '--simulate',
        '--slo', '--slo-admission', '--slo-admissions', '--slo-reserved-slots', '--slo-reserved-slots-list',
        '--slo-tpot-ms', '--slo-ttft-ms', '--spec-acceptance-rate', '--speculative-config', '--spread',
        '--static-padding', '--swap-space', '--swap-space-gb', '--tensor-parallel-size', '--time-scale',
        '--tokenizer', '--tpot-slo-ms', '--trace', '--truncation', '--ttft-slo-ms', '--warmup-requests', '--workload',
        '-h',
    }),
    'profile': frozenset({
        '--allow-runtime-lora-updating', '--block-size', '--check', '--config', '--convert', '--cpu-clock',
        '--deterministic', '--device', '--distributed-executor-backend', '--dtype', '--enable-chunked-prefill',
        '--enable-lora', '--enable-prefix-caching', '--enforce-eager', '--extra-llm-api-options',
        '--extra_llm_api_options', '--gpu-memory-utilization', '--help', '--knots', '--kv-cache-dtype',
        '--kv-cache-memory-fraction', '--kv-offload-dir', '--kv-offload-max-bytes', '--long-prefill-token-threshold',
        '--lora-modules', '--max-batch-size', '--max-cpu-loras', '--max-input-len', '--max-long-partial-prefills',
        '--max-lora-rank', '--max-loras', '--max-model-len', '--max-num-batched-tokens', '--max-num-partial-prefills',
        '--max-num-seqs', '--max-num-tokens', '--max-preemptions-per-request', '--max-wait-s',
        '--max-waiting-requests', '--model', '--no-allow-runtime-lora-updating', '--no-deterministic',
        '--no-enable-chunked-prefill', '--no-enable-lora', '--no-enable-prefix-caching', '--no-enforce-eager',
        '--no-progress', '--no-record-steps', '--no-static-padding', '--num-gpu-blocks-override', '--num-kv-blocks',
        '--num-swap-blocks', '--num-threads', '--output', '--pipeline-micro-batches', '--pipeline-parallel-size',
        '--preemption-mode', '--prefill-attention', '--quantization', '--record-steps', '--refit',
        '--request-timeout', '--runner', '--scheduler-policy', '--scheduling-order', '--seed', '--slo-admission',
        '--slo-reserved-slots', '--speculative-config', '--static-padding', '--swap-space', '--swap-space-gb',
        '--tensor-parallel-size', '--tokenizer', '--tpot-slo-ms', '--truncation', '--ttft-slo-ms', '--with-run', '-h',
    }),
    'simulate': frozenset({
        '--allow-runtime-lora-updating', '--allreduce-bandwidth-gbs', '--allreduce-latency-us', '--arrival',
        '--block-size', '--burstiness', '--compare-static', '--config', '--convert', '--dataset', '--dataset-name',
        '--dataset-path', '--decode-time-scale', '--deterministic', '--device', '--device-preset', '--disable-tqdm',
        '--distributed-executor-backend', '--dtype', '--enable-chunked-prefill', '--enable-lora',
        '--enable-prefix-caching', '--enforce-eager', '--extra-llm-api-options', '--extra_llm_api_options',
        '--find-layout', '--goodput', '--gpu', '--gpu-memory-utilization', '--help', '--host-memory-gib',
        '--ignore-eos', '--input-len', '--kv-cache-dtype', '--kv-cache-memory-fraction', '--kv-offload-dir',
        '--kv-offload-max-bytes', '--long-input-len', '--long-output-len', '--long-prefill-token-threshold',
        '--long-ratio', '--lora-adapters', '--lora-modules', '--lora-rank', '--lora-targets', '--max-batch-size',
        '--max-concurrency', '--max-cpu-loras', '--max-hosts', '--max-input-len', '--max-long-partial-prefills',
        '--max-lora-rank', '--max-loras', '--max-model-len', '--max-num-batched-tokens', '--max-num-partial-prefills',
        '--max-num-seqs', '--max-num-tokens', '--max-output-len', '--max-preemptions-per-request', '--max-wait-s',
        '--max-waiting-requests', '--model', '--model-shapes', '--no-allow-runtime-lora-updating',
        '--no-deterministic', '--no-enable-chunked-prefill', '--no-enable-lora', '--no-enable-prefix-caching',
        '--no-enforce-eager', '--no-ignore-eos', '--no-plots', '--no-progress', '--no-record-steps',
        '--no-save-result', '--no-static-padding', '--num-gpu-blocks-override', '--num-kv-blocks', '--num-prefixes',
        '--num-prompts', '--num-requests', '--num-swap-blocks', '--num-threads', '--num-warmups', '--output-dir',
        '--output-len', '--percentile-metrics', '--pipeline-micro-batches', '--pipeline-parallel-size',
        '--preemption-mode', '--prefill-attention', '--prefix-len', '--profile', '--quantization',
        '--random-input-len', '--random-output-len', '--random-range-ratio', '--ranks-per-host', '--record-steps',
        '--replicas', '--request-rate', '--request-timeout', '--result-dir', '--router', '--runner', '--save-result',
        '--scheduler-policy', '--scheduling-order', '--seed', '--sigma', '--slo-admission', '--slo-reserved-slots',
        '--slo-tpot-ms', '--slo-ttft-ms', '--spec-acceptance-rate', '--speculative-config', '--spread',
        '--static-padding', '--swap-space', '--swap-space-gb', '--sweep-rates', '--target-slo-attainment',
        '--target-throughput', '--tensor-parallel-size', '--time-scale', '--timeline-steps', '--tokenizer',
        '--tpot-slo-ms', '--trace', '--truncation', '--ttft-slo-ms', '--warmup-requests', '--workload', '-h',
    }),
    'doctor': frozenset({
        '--api-key', '--help', '--json', '--no-simulate', '--profile', '--set', '--slo-tpot-ms', '--slo-ttft-ms',
        '--url', '--window', '-h',
    }),
}
# END GENERATED
# fmt: on


def flags_of_parsers(command: str) -> frozenset[str]:
    """The flags of `command` as its parsers define them now (imports the command's modules)."""
    import importlib

    flags: set[str] = set()
    for target in PARSERS[command]:
        module, function = target.split(":")
        flags.update(getattr(importlib.import_module(module), function)()._option_string_actions)
    return frozenset(flags)


def generated_table() -> str:
    lines = ["COMMAND_FLAGS: dict[str, frozenset[str]] = {"]
    for command in PARSERS:
        lines.append(f"    {command!r}: frozenset({{")
        line = "       "
        for flag in sorted(flags_of_parsers(command)):
            if len(line) + len(flag) + 4 > 118:
                lines.append(line)
                line = "       "
            line += f" {flag!r},"
        lines.append(line)
        lines.append("    }),")
    lines.append("}")
    return "\n".join(lines)


def rewrite() -> None:
    path = Path(__file__)
    text = path.read_text()
    head, rest = text.split("# BEGIN GENERATED\n", 1)
    _, tail = rest.split("# END GENERATED\n", 1)
    path.write_text(f"{head}# BEGIN GENERATED\n{generated_table()}\n# END GENERATED\n{tail}")


if __name__ == "__main__":
    rewrite()
    sys.exit(0)
