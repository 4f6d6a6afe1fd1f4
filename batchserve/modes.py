"""Which combinations of modes run, which are refused and which fall back: one table, evaluated once at start-up.

Each row of RULES is plain data: a condition (a small predicate over ModeFacts, and the same condition in words), a
verdict, the reason, what would work (a refusal) or what runs instead (a fallback), the options it concerns and the
docs page that explains it. `decide` evaluates every row once the options, the model's config and the host are known,
before anything is allocated (engine/startup.py): every refusal raises one ModeRefused naming the options and what
works; every fallback is one log line (`log_fallbacks`), a Prometheus label (`batchserve:mode_fallback{rule=...}`)
and, where the engine runs another option than the one asked for, that option's effective value (`adjust`).
The configuration page renders the table (`markdown_table`), so the docs are the code.

Rows with verdict RUN say what is covered where a reader could doubt it (determinism with quantized weights, an 8-bit
KV pool); they never fire a log. Torch-free: this module sits beside config.py, and its tests need no model.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from batchserve.config import ConfigError, EngineConfig, SpeculativeConfig
from batchserve.mode_facts import QUANTIZED_WEIGHTS, ModeFacts, model_traits  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)


class Verdict(enum.StrEnum):
    RUN = "run"  # runs as asked, and the guarantee holds
    REFUSE = "refuse"  # refused at start, naming what would work
    FALL_BACK = "fall back"  # runs, on another path or with an option off: one log line and a metric label


EIGHT_BIT_KV = ("int8", "fp8_e4m3")
FLOAT_KV = ("bfloat16", "float32")


@dataclass(frozen=True)
class Rule:
    """One row: when `applies` holds, `verdict`. `condition` says the same as `applies`, in words, for the docs;
    `remedy` is what would work (a refusal) or what runs instead (a fallback); `adjust` sets the option the engine
    runs differently from the one asked for (a fallback that turns an option off)."""

    name: str
    verdict: Verdict
    options: tuple[str, ...]
    condition: str
    applies: Callable[[ModeFacts], bool]
    reason: str
    remedy: str
    anchor: str  # docs page (and anchor) that explains it
    adjust: Callable[[EngineConfig], None] | None = None

    def message(self) -> str:
        return f"{self.condition}: {self.reason}; {self.remedy} (docs/{self.anchor})"


def _speculation_off(config: EngineConfig) -> None:
    config.speculative_config = None


def _eager(config: EngineConfig) -> None:
    config.enforce_eager = True


def _no_reserved_slots(config: EngineConfig) -> None:
    config.scheduler.slo_reserved_slots = 0


def _tier_off(config: EngineConfig) -> None:
    config.cache.kv_offload_dir = None


def _split(f: ModeFacts) -> bool:
    """The model is split over ranks."""
    return f.tensor_parallel_size > 1 or f.pipeline_parallel_size > 1


def _cuda_graphs_wanted(f: ModeFacts) -> bool:
    return f.device == "cuda" and not f.enforce_eager


RULES: tuple[Rule, ...] = (
    # ---- refused at start
    Rule(
        "quantized_weights_off_cpu", Verdict.REFUSE, ("quantization", "device"),
        "quantization int8 / int4 / gguf on a GPU",
        lambda f: f.quantization in QUANTIZED_WEIGHTS and f.device != "cpu",
        "the quantized GEMM kernels run on the CPU only",
        "use quantization none on the GPU, or device cpu",
        "quantization.md",
    ),
    Rule(
        "gguf_codes_need_a_gguf_file", Verdict.REFUSE, ("quantization", "model"),
        "quantization gguf with a model that is not a .gguf file",
        lambda f: f.quantization == "gguf" and f.gguf_file is False,
        "quantization gguf runs a GGUF file's own quantized tensors as stored",
        "for a Hugging Face folder use quantization int8 or int4 (quantized at load), or none",
        "quantization.md",
    ),
    Rule(
        "eight_bit_kv_with_windows_or_softcaps", Verdict.REFUSE, ("kv_cache_dtype",),
        "kv_cache_dtype int8 / fp8_e4m3 with a model whose attention is windowed or soft-capped (Gemma 2/3, a "
        "windowed Mistral, Qwen or Phi-3)",
        lambda f: f.kv_cache_dtype in EIGHT_BIT_KV and (f.windowed or f.softcapped),
        "windowed and soft-capped attention run the torch code, which reads float pools only",
        "use kv_cache_dtype auto, bfloat16 or float32 for this model",
        "kv-cache-quantization.md#where-it-runs-today",
    ),
    Rule(
        "deterministic_with_speculation", Verdict.REFUSE, ("deterministic", "speculative_config"),
        "deterministic with speculative_config",
        lambda f: f.deterministic and f.speculative_method is not None,
        "whether a request speculates, and how many drafts, follows the running batch's size, and a sampled request's "
        "draws follow its drafts, so its tokens would depend on what shares its batch",
        "drop speculative_config (greedy speculation gives plain greedy's tokens anyway), or drop deterministic",
        "determinism.md#what-it-guarantees",
    ),
    Rule(
        "kv_offload_needs_prefix_caching", Verdict.REFUSE, ("kv_offload_dir", "enable_prefix_caching"),
        "kv_offload_dir with enable_prefix_caching off",
        lambda f: f.kv_offload and not f.prefix_caching,
        "the disk tier stores and finds blocks by their prefix hashes, which only the prefix cache computes",
        "turn enable_prefix_caching on, or drop kv_offload_dir",
        "kv-offload.md#what-runs-with-it",
    ),
    Rule(
        "lora_with_moe", Verdict.REFUSE, ("enable_lora",),
        "enable_lora with a mixture-of-experts model",
        lambda f: f.lora and f.moe,
        "adapters are applied to the dense projections; the experts' stacked weights take none",
        "serve the adapter on a dense model, or merge it into the MoE weights (peft's merge_and_unload)",
        "lora.md#what-runs-where",
    ),
    Rule(
        "lora_with_static_batching", Verdict.REFUSE, ("enable_lora", "scheduler_policy"),
        "enable_lora with scheduler_policy static",
        lambda f: f.lora and f.scheduler_policy == "static",
        "a static batch is formed whole, while the max_loras limit is kept as requests join the running set",
        "use scheduler_policy max_utilization or guaranteed_no_evict",
        "lora.md#what-runs-where",
    ),
    Rule(
        "pipeline_parallel_with_speculation", Verdict.REFUSE, ("pipeline_parallel_size", "speculative_config"),
        "pipeline_parallel_size > 1 with speculative_config",
        lambda f: f.pipeline_parallel_size > 1 and f.speculative_method is not None,
        "the last stage verifies the drafts, and the earlier stages' request tables do not roll rejected drafts back",
        "drop speculative_config, or use tensor_parallel_size instead of pipeline stages",
        "parallelism.md#what-is-not-built",
    ),
    Rule(
        "lora_with_parallel_ranks", Verdict.REFUSE, ("enable_lora", "tensor_parallel_size", "pipeline_parallel_size"),
        "enable_lora with tensor_parallel_size or pipeline_parallel_size > 1",
        lambda f: f.lora and _split(f),
        "the adapters' slots live in rank 0's process and the other ranks' shards would take no adapter",
        "serve adapters on one rank (several replicas for throughput), or merge the adapter and split the merged model",
        "lora.md#what-runs-where",
    ),
    Rule(
        "kv_offload_with_parallel_ranks", Verdict.REFUSE, ("kv_offload_dir", "tensor_parallel_size",
                                                            "pipeline_parallel_size"),
        "kv_offload_dir with tensor_parallel_size or pipeline_parallel_size > 1",
        lambda f: f.kv_offload and _split(f),
        "the tier reads and writes rank 0's pool only, and each rank holds other heads or layers",
        "drop kv_offload_dir, or run one rank",
        "kv-offload.md#what-runs-with-it",
    ),
    Rule(
        "parallel_ranks_off_cpu", Verdict.REFUSE, ("tensor_parallel_size", "pipeline_parallel_size", "device"),
        "tensor_parallel_size or pipeline_parallel_size > 1 on a GPU",
        lambda f: _split(f) and f.device != "cpu",
        "the ranks' collectives are gloo's over CPU tensors (no NCCL path is built)",
        "use device cpu, or tensor_parallel_size 1 on the GPU",
        "parallelism.md#what-is-not-built",
    ),
    Rule(
        "parallel_ranks_with_quantized_weights", Verdict.REFUSE, ("tensor_parallel_size", "pipeline_parallel_size", "quantization"),
        "tensor_parallel_size or pipeline_parallel_size > 1 with quantization int8 / int4 / gguf",
        lambda f: _split(f) and f.quantization in QUANTIZED_WEIGHTS,
        "the ranks load their shards as float weights: the quantized layouts (per-channel scales, groups of k, a GGUF "
        "file's blocks) are not cut into shards yet (a row-parallel cut must fall on a group's edge)",
        "use quantization none (bfloat16 or float32 shards), or tensor_parallel_size 1",
        "parallelism.md#what-is-not-built",
    ),
    Rule(
        "tensor_parallel_with_a_draft_model", Verdict.REFUSE, ("tensor_parallel_size", "speculative_config"),
        "tensor_parallel_size > 1 with speculative method draft_model",
        lambda f: f.tensor_parallel_size > 1 and f.speculative_method == "draft_model",
        "the draft model runs in rank 0's process, whole, and is not sharded",
        "use method ngram or suffix (their drafts come from the scheduler), or tensor_parallel_size 1",
        "parallelism.md#what-is-not-built",
    ),
    # ---- fall back: runs, logged once, labelled in the metrics
    Rule(
        "kv_offload_with_windows", Verdict.FALL_BACK, ("kv_offload_dir",),
        "kv_offload_dir with a model whose attention is windowed (Mistral's sliding_window, Gemma 2/3, a windowed "
        "Qwen or Phi-3)",
        lambda f: f.kv_offload and f.windowed,
        "not built for windows yet: a model whose every layer is windowed hands blocks that left the window back to "
        "the pool while it runs, so a prefix read back would fill blocks no step reads",
        "the disk tier is off (the effective config says kv_offload_dir=None)",
        "kv-offload.md#what-runs-with-it",
        adjust=_tier_off,
    ),
    Rule(
        "kv_offload_off_the_cpu", Verdict.FALL_BACK, ("kv_offload_dir", "device"),
        "kv_offload_dir on a GPU",
        lambda f: f.kv_offload and f.device != "cpu",
        "the tier's writer and readers address the pool's memory from threads of their own, which a GPU's pool is "
        "not; it is built and tested for the CPU, where recomputing a prompt costs the most",
        "the disk tier is off (the effective config says kv_offload_dir=None)",
        "kv-offload.md#what-runs-with-it",
        adjust=_tier_off,
    ),
    Rule(
        "lora_steps_without_cuda_graphs", Verdict.FALL_BACK, ("enable_lora", "enforce_eager"),
        "enable_lora on a GPU with CUDA graphs",
        lambda f: f.lora and _cuda_graphs_wanted(f),
        "the captured decode graphs hold no adapter",
        "a decode step with adapters runs eagerly; steps of the base model alone replay the graphs",
        "lora.md#what-runs-where",
    ),
    Rule(
        "parallel_ranks_run_python_layers", Verdict.FALL_BACK, ("tensor_parallel_size", "pipeline_parallel_size"),
        "tensor_parallel_size or pipeline_parallel_size > 1 on the CPU with the native kernels",
        lambda f: _split(f) and f.device == "cpu" and f.native_kernels,
        "the native decoder loop runs all layers in one call, with no all-reduce after o_proj and the MLP and no "
        "hand-over between stages",
        "every step runs the Python layers (the same operators, one call each) with the collectives between them",
        "parallelism.md#how-a-layer-is-split",
    ),
    Rule(
        "ray_ranks_all_reduce_by_gloo", Verdict.FALL_BACK, ("distributed_executor_backend", "tensor_parallel_size"),
        "distributed_executor_backend ray with tensor_parallel_size > 1",
        lambda f: f.executor_backend == "ray" and f.tensor_parallel_size > 1,
        "a Ray placement may put a stage's ranks on different hosts, and shared memory joins one host's processes only",
        "the ranks all-reduce through gloo over TCP, not the mp backend's shared-memory all-reduce",
        "parallelism.md#ranks-on-a-ray-cluster",
    ),
    Rule(
        "static_policy_drops_speculation", Verdict.FALL_BACK, ("scheduler_policy", "speculative_config"),
        "scheduler_policy static with speculative_config",
        lambda f: f.scheduler_policy == "static" and f.speculative_method is not None,
        "static batching is the no-frills baseline: a batch formed whole runs to its end without drafts",
        "speculation is off (the effective config says speculative_config=None)",
        "speculative-decoding.md",
        adjust=_speculation_off,
    ),
    Rule(
        "static_policy_keeps_no_slots", Verdict.FALL_BACK, ("scheduler_policy", "slo_reserved_slots"),
        "scheduler_policy static with slo_reserved_slots > 0 (by default a quarter of max_batch_size under "
        "slo_admission refuse)",
        lambda f: f.scheduler_policy == "static" and f.slo_reserved_slots > 0,
        "a static batch is formed whole from the queue's head and nobody joins it, so there is no later slot to keep",
        "no slot is kept (the effective config says slo_reserved_slots=0); SLO admission still refuses a request "
        "predicted to miss its targets",
        "slo.md#admission-by-predicted-ttft",
        adjust=_no_reserved_slots,
    ),
    Rule(
        "kv_pool_dtype_not_the_models", Verdict.FALL_BACK, ("kv_cache_dtype", "dtype"),
        "kv_cache_dtype bfloat16 / float32 other than the model's dtype, on the CPU with the native kernels",
        lambda f: f.device == "cpu" and f.native_kernels and f.kv_cache_dtype in FLOAT_KV and f.kv_cache_dtype != f.dtype,
        "the native K/V store and step attention take a pool of the model's dtype or 8-bit codes",
        "every step runs the Python layers, each operator a call of its own (kv_cache_dtype auto keeps the one-call "
        "native step)",
        "kv-cache-quantization.md",
    ),
    Rule(
        "float16_on_cpu_runs_the_torch_code", Verdict.FALL_BACK, ("dtype",),
        "dtype float16 on the CPU with the native kernels",
        lambda f: f.device == "cpu" and f.native_kernels and f.dtype == "float16",
        "the native norm, RoPE, SwiGLU, K/V store and decoder loop take float32 and bfloat16 only",
        "every step runs the Python layers and torch's element-wise operators (dtype bfloat16 or float32 keep the "
        "native step)",
        "cpu-kernels.md#dtype-and-exactness",
    ),
    Rule(
        "eight_bit_kv_on_gpu", Verdict.FALL_BACK, ("kv_cache_dtype", "device"),
        "kv_cache_dtype int8 / fp8_e4m3 on a GPU",
        lambda f: f.device == "cuda" and f.kv_cache_dtype in EIGHT_BIT_KV,
        "the Triton attention kernels read float pools only",
        "attention dequantizes the context in torch every step, and decode steps run eagerly (no CUDA graphs)",
        "gpu.md",
        adjust=_eager,
    ),
    Rule(
        "moe_without_cuda_graphs", Verdict.FALL_BACK, ("enforce_eager",),
        "a mixture-of-experts model on a GPU",
        lambda f: _cuda_graphs_wanted(f) and f.moe,
        "the MoE layers split each step's tokens by expert on the host, which a captured graph cannot replay",
        "decode steps run eagerly (no CUDA graphs)",
        "gpu.md",
        adjust=_eager,
    ),
    Rule(
        "deterministic_off_the_cpu", Verdict.FALL_BACK, ("deterministic", "device"),
        "deterministic on a GPU",
        lambda f: f.deterministic and f.device != "cpu",
        "the GPU kernels (cuBLAS, Triton attention) are not made batch-invariant",
        "the engine runs, row-per-decode attention and float32 logits included, but tokens may follow the batch",
        "determinism.md#what-it-guarantees",
    ),
    Rule(
        "deterministic_without_native_kernels", Verdict.FALL_BACK, ("deterministic",),
        "deterministic on a CPU without the native kernels",
        lambda f: f.deterministic and f.device == "cpu" and not f.native_kernels,
        "the torch code's GEMMs and attention pick their blocking from the batch's shape",
        "the engine runs, but tokens may follow the batch",
        "determinism.md#what-it-guarantees",
    ),
    Rule(
        "deterministic_with_windows_or_softcaps", Verdict.FALL_BACK, ("deterministic",),
        "deterministic with a model whose attention is windowed or soft-capped",
        lambda f: f.deterministic and (f.windowed or f.softcapped),
        "windowed and soft-capped layers attend by the torch code, whose reductions follow the batch's shape",
        "the engine runs, its GEMMs in one order per row, but tokens may follow the batch",
        "determinism.md#what-it-guarantees",
    ),
    # ---- covered: said here because a reader could doubt it
    Rule(
        "quantization_auto", Verdict.RUN, ("quantization", "dtype", "model"),
        "quantization auto (the default)",
        lambda f: f.quantization_auto,
        "a GGUF file whose matrices the as-stored kernels take runs as stored (as quantization gguf) in bfloat16 where "
        "the kernel table's rule records that faster on this CPU, on a weight-only path (never W8A8); float32 (the exactness "
        "reference), a GPU, split ranks, LoRA, a mixture-of-experts model or a Hugging Face folder load dequantized (as "
        "quantization none); one start-up line says which and why",
        "quantization none keeps the dequantized model; quantization gguf asks for the codes as stored",
        "quantization.md#quantization-auto",
    ),
    Rule(
        "deterministic_with_quantized_weights", Verdict.RUN, ("deterministic", "quantization"),
        "deterministic with quantization int8 / int4 / gguf",
        lambda f: f.deterministic and f.quantization in QUANTIZED_WEIGHTS,
        "the quantized GEMM takes its small-M kernel at every row count: one order per row",
        "covered by the guarantee",
        "determinism.md#what-it-guarantees",
    ),
    Rule(
        "deterministic_with_eight_bit_kv", Verdict.RUN, ("deterministic", "kv_cache_dtype"),
        "deterministic with kv_cache_dtype int8 / fp8_e4m3",
        lambda f: f.deterministic and f.kv_cache_dtype in EIGHT_BIT_KV,
        "each token's K/V is quantized on its own, and every row attends as a decode over the stored codes",
        "covered by the guarantee",
        "determinism.md#what-it-guarantees",
    ),
)  # fmt: skip


class ModeRefused(ConfigError):
    """A combination of options the engine does not run: each refused rule, with what would work."""

    def __init__(self, refused: list[Rule]) -> None:
        self.rules = refused
        lines = [f"[{', '.join(rule.options)}] {rule.message()}" for rule in refused]
        super().__init__("refused at start: " + " | ".join(lines))


@dataclass(frozen=True)
class ModeDecision:
    """The rows that held for one engine's facts, by verdict."""

    facts: ModeFacts
    refused: tuple[Rule, ...] = ()
    fallbacks: tuple[Rule, ...] = ()
    covered: tuple[Rule, ...] = ()

    @property
    def fallback_names(self) -> list[str]:
        return [rule.name for rule in self.fallbacks]


def decide(facts: ModeFacts, rules: Iterable[Rule] = RULES) -> ModeDecision:
    """Every row evaluated on `facts`, in the table's order."""
    held = [rule for rule in rules if rule.applies(facts)]
    return ModeDecision(
        facts,
        refused=tuple(r for r in held if r.verdict == Verdict.REFUSE),
        fallbacks=tuple(r for r in held if r.verdict == Verdict.FALL_BACK),
        covered=tuple(r for r in held if r.verdict == Verdict.RUN),
    )


def enforce(config: EngineConfig, facts: ModeFacts) -> ModeDecision:
    """The table applied to an engine about to start: raises ModeRefused if any row refuses; else logs each fallback
    once, sets the options the fallbacks change in `config` (so the effective config says what runs) and returns the
    decision."""
    decision = decide(facts)
    if decision.refused:
        raise ModeRefused(list(decision.refused))
    log_fallbacks(decision)
    for rule in decision.fallbacks:
        if rule.adjust is not None:
            rule.adjust(config)
    return decision


def log_fallbacks(decision: ModeDecision) -> None:
    for rule in decision.fallbacks:
        logger.warning("mode fallback %s: %s", rule.name, rule.message())


def effective_speculation(config: EngineConfig) -> SpeculativeConfig | None:
    """The speculative config a scheduler runs under `config` by the table's rows on speculation (the simulator's
    question: it has no model or host to ask about); a row that turns it off is logged."""
    facts = ModeFacts.of(config, None, "cpu", str(config.dtype), native_kernels=True)
    decision = decide(facts)
    if decision.refused:
        raise ModeRefused(list(decision.refused))
    trial = dataclasses.replace(config)
    for rule in decision.fallbacks:
        if "speculative_config" in rule.options and rule.adjust is not None:
            logger.warning("mode fallback %s: %s", rule.name, rule.message())
            rule.adjust(trial)
    return SpeculativeConfig.from_value(trial.speculative_config)


def markdown_table(rules: Iterable[Rule] = RULES) -> str:
    """The table as the configuration page shows it (docs/hooks/reference.py)."""
    header = (
        "| rule | when | verdict | why | what would work / what runs | options | more |\n|---|---|---|---|---|---|---|"
    )
    rows = [
        f"| `{r.name}` | {_cell(r.condition)} | **{r.verdict.value}** | {_cell(r.reason)} | {_cell(r.remedy)} | "
        f"{', '.join(f'`{o}`' for o in r.options)} | [{r.anchor.split('#')[0].removesuffix('.md')}]({r.anchor}) |"
        for r in rules
    ]
    return header + "\n" + "\n".join(rows)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def summary(decision: ModeDecision) -> dict[str, Any]:
    """The fired rows by verdict, for logs and tests."""
    return {
        "refused": [r.name for r in decision.refused],
        "fallbacks": decision.fallback_names,
        "covered": [r.name for r in decision.covered],
    }
