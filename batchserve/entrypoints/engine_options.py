"""The one schema of engine options, whatever the edge they come through: `LLM(...)` keywords, a `--config` JSON file,
command-line flags (engine_args.py builds them, and their --help, from this table).

Types are checked here, strictly (pydantic): 8.5 is not an int, "no" is not a bool, "eight" is not a number. Names
are ours, TensorRT-LLM's or vLLM's (config.ALIASES); enum values match in any case (GUARANTEED_NO_EVICT); vLLM's and
llama.cpp's options we lack are answered as their flags are (foreign_flags.py); an unknown name gets a known one of
the same meaning as a suggestion. Ranges stay with the dataclasses (config.py `validate()`), which
the engine trusts: the schema says what type a value has, the dataclass whether it can work.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import logging
import types
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from pydantic import BaseModel, BeforeValidator, ConfigDict, ValidationError, create_model

from batchserve.config import (
    ALIASES,
    DEVICES,
    DTYPES,
    EXECUTOR_BACKENDS,
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    VLLM_ALIASES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
)
from batchserve.entrypoints.foreign_flags import foreign_option, similar_name
from batchserve.entrypoints.llm_api_options import enum_value, flatten_llm_api_options

logger = logging.getLogger(__name__)

# What each option does; "(default: ...)" where the default is not a plain value the dataclass holds.
HELP: dict[str, str] = {
    "model": "HF directory or .gguf file (default: SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer directory (default: the model's)",
    "dtype": "weights and activations; auto: bfloat16 where the device multiplies it natively, else float32; "
    "bfloat16 / float16 on a CPU without their matmul units compute in float32 on widened weights (half, fp16, bf16, "
    "fp32 accepted)",
    "device": "auto: CUDA when torch sees a GPU, else the CPU",
    "speculative_config": 'speculative decoding, vLLM\'s shape as JSON: {"method": "ngram", '
    '"num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}, method suffix, or a '
    'draft model of the same tokenizer: {"model": "path", "num_speculative_tokens": 4} '
    "(docs/speculative-decoding.md; default: off)",
    "seed": "seed of torch's RNG, and of sampling for requests without a seed of their own",
    "num_threads": "torch intra-op threads on CPU (default: torch's choice)",
    "record_steps": "keep a record of every engine step (benchmark traces and timelines)",
    "enforce_eager": "on a GPU, run every step eagerly: no CUDA graphs of decode steps (captured at start-up for "
    "a ladder of batch sizes otherwise)",
    "deterministic": "a request's output does not depend on what shares its batch (or on chunking, preemption, "
    "prefix-cache hits): GEMMs and attention in one reduction order per row, at a cost (docs/determinism.md)",
    "runner": "generate: text generation; pooling: embeddings, scores and rerank (and generation too where the "
    "model has its LM head); auto: pooling for a sentence-transformers folder or a classification head "
    "(docs/embeddings.md)",
    "convert": "a pooling runner's task: embed (pooled hidden states) or classify (a *ForSequenceClassification "
    "head; on a causal LM, the yes/no logits of a Qwen3-Reranker-style prompt); auto: from the model folder",
    "prefill_attention": "how prompts attend on the CPU: native kernel, sdpa (torch's, one call per prompt) or split "
    "(prompts of <= 128 tokens native, batched; longer sdpa); auto: split for a bf16 KV pool on a CPU with AMX, "
    "native otherwise (docs/cpu-kernels.md)",
    "quantization": "weights kept quantized on the CPU, quantized at load: int8 (per output channel), int4 (groups "
    "of 32 k; int4_g64, int4_g128); gguf: a GGUF file's own codes as stored; none: dequantized; auto (default): "
    "gguf for a GGUF file in bfloat16 where this CPU runs it faster, else none, said in one start-up line "
    "(docs/quantization.md)",
    "enable_lora": "serve LoRA adapters on top of the base model: a request names one by `model` (docs/lora.md)",
    "lora_modules": 'adapters loaded at start, "name=path name2=path2" (PEFT folders; needs enable_lora)',
    "max_loras": "distinct adapters in one step (their weights' device slots)",
    "max_lora_rank": "the largest adapter rank accepted; a higher one is refused at load",
    "max_cpu_loras": "adapters kept loaded in host memory, least recently used dropped beyond (default: max_loras)",
    "allow_runtime_lora_updating": "answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter: adapters "
    "loaded and unloaded while the server runs (vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; default: off)",
    "tensor_parallel_size": "ranks each holding a shard of every layer (heads, MLP columns, vocabulary), one process "
    "each (on this host, or placed by Ray: distributed_executor_backend), the CPU only; the model's heads and "
    "intermediate size must split evenly; --num-threads is per rank (docs/parallelism.md)",
    "pipeline_parallel_size": "pipeline stages: the layers split in M runs, one process a rank; it fits a model into "
    "memory, not a faster step (docs/parallelism.md)",
    "pipeline_micro_batches": "with pipeline stages, split a step's decode rows into this many micro-batches in "
    "flight, so the stages compute at once (default 1: off; measured slower on the CPU, where a decode micro-batch "
    "streams its stage's weights as the whole batch does: docs/parallelism.md)",
    "distributed_executor_backend": "how ranks are placed: mp, one process per rank on this host; ray, ranks 1.. as "
    "actors of a Ray placement group (a bundle of --num-threads CPUs a rank, rank 0's on this node; the cluster of "
    "RAY_ADDRESS, else a local one; docs/parallelism.md)",
    "max_batch_size": "sequences in one forward pass",
    "max_num_tokens": "tokens in one forward pass: prefill chunks plus one per decoding sequence",
    "scheduler_policy": "max_utilization: fill the budget, preempt when blocks run out; guaranteed_no_evict: reserve "
    "each request's worst case, never preempt; static: classic static batching (the baseline)",
    "scheduling_order": "fcfs; priority: the request's integer, lower first; shortest_first: prompt + max_tokens, "
    "with aging after max_wait_s",
    "max_wait_s": "shortest_first: a request waiting longer than this (seconds) goes ahead of newer ones",
    "request_timeout": "seconds a served request may take, waiting and running, when it gives no `timeout` of its "
    "own: then it is ended with a timeout error and its KV blocks are freed (default: no limit)",
    "enable_chunked_prefill": "split a prompt longer than the step's remaining token budget over several steps",
    "preemption_mode": "recompute: drop a preempted request's blocks and prefill again later; swap: park them in "
    "host memory (swap_space_gb)",
    "max_model_len": "prompt + output tokens of one request (default: the model's context, at most what the KV pool "
    "holds)",
    "max_input_len": "prompt tokens (default: max_model_len - 1)",
    "truncation": "a prompt over max_input_len: error (refuse it), left (keep its end), right (keep its start)",
    "max_waiting_requests": "bound of the waiting queue; when full the server answers 503 (default: unbounded)",
    "static_padding": "static policy: a finished member is computed as padding until its whole batch is done",
    "long_prefill_token_threshold": "a prompt with more tokens than this left to compute is long: it is chunked to "
    "at most this many tokens a step, so running decodes never wait a whole long prefill (default 0: off)",
    "max_num_partial_prefills": "prompts of any length prefilling (chunked) at once (default: no cap)",
    "max_long_partial_prefills": "long prompts (long_prefill_token_threshold) prefilling at once (default: no cap)",
    "ttft_slo_ms": "time-to-first-token target of requests that set none, ms: goodput counts requests within "
    "their targets; slo_admission acts on them (docs/slo.md; default: none)",
    "tpot_slo_ms": "time-per-output-token target of requests that set none, ms (default: none)",
    "slo_admission": "a waiting request predicted to miss its TTFT target: off (serve it anyway), refuse (503 with "
    "Retry-After at admission, dropped from the queue later), deprioritize (served after those that can still meet "
    "theirs); preemption then picks the running request with the most slack",
    "max_preemptions_per_request": "a request preempted this many times is pinned: never preempted again, so "
    "preemption cannot thrash (default: no bound)",
    "slo_reserved_slots": "batch slots only a request that cannot wait for another may take (its TTFT slack under "
    "the predicted wait for a regular slot), so that requests with loose targets (long summaries) cannot fill the "
    "batch while tight ones queue (default: a quarter of max_batch_size under slo_admission refuse, else 0)",
    "block_size": "tokens per KV block, 8-128",
    "num_kv_blocks": "KV pool size in blocks (default: from kv_cache_memory_fraction; `generate` and the offline LLM "
    "size it to their requests, up to that)",
    "kv_cache_memory_fraction": "KV pool as a fraction of the memory free after the weights load (default: 0.9 on "
    "GPU; on CPU 0.25, at most 4 GiB)",
    "kv_cache_dtype": "the KV pool's element type: auto (the model's dtype), bfloat16, float32, int8 or fp8_e4m3 (per "
    "token and head scales: about twice the tokens of bfloat16; docs/kv-cache-quantization.md)",
    "enable_prefix_caching": "share full KV blocks between requests with a common prefix",
    "swap_space_gb": "host memory for swapped-out KV blocks, GiB (preemption_mode swap)",
    "num_swap_blocks": "host swap pool size in blocks (default: from swap_space_gb)",
    "kv_offload_dir": "a directory for the disk KV tier: full prefix blocks evicted from the pool are read back from "
    "it instead of recomputed, across restarts and by replicas sharing it (docs/kv-offload.md; default: off)",
    "kv_offload_max_bytes": "the disk KV tier's size cap in bytes, least valuable blocks deleted first (default: 16 GiB)",
}

# vLLM's and torch's short names for our dtypes
DTYPE_ALIASES = {"half": "float16", "fp16": "float16", "bf16": "bfloat16", "float": "float32", "fp32": "float32"}

_CLASSES = (EngineConfig, SchedulerConfig, CacheConfig)
_NESTED = {"scheduler", "cache"}


@dataclass(frozen=True)
class OptionSpec:
    """One engine option: its name, type (without None), default, help, choices, and vLLM's name for it (a flag too;
    TensorRT-LLM's names are for config files, config.ALIASES)."""

    name: str
    kind: Any  # int, float, str, bool, or an enum class
    default: Any
    help: str
    choices: tuple[str, ...] | None
    aliases: tuple[str, ...]


def _without_none(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        return next(a for a in get_args(annotation) if a is not type(None))
    return annotation


def _choices(name: str, kind: Any) -> tuple[str, ...] | None:
    if isinstance(kind, type) and issubclass(kind, enum.Enum):
        return tuple(m.value for m in kind)
    choices = {
        "dtype": DTYPES,
        "device": DEVICES,
        "quantization": QUANTIZATIONS,
        "kv_cache_dtype": KV_CACHE_DTYPES,
        "distributed_executor_backend": EXECUTOR_BACKENDS,
    }
    return choices.get(name)


def option_specs() -> list[OptionSpec]:
    """Every engine option, in the dataclasses' order (engine, scheduler, cache)."""
    specs = []
    for cls in _CLASSES:
        hints = get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if f.name in _NESTED:
                continue
            kind = _without_none(hints[f.name])
            aliases = tuple(alias for alias, target in VLLM_ALIASES.items() if target == f.name)
            specs.append(OptionSpec(f.name, kind, f.default, HELP[f.name], _choices(f.name, kind), aliases))
    return specs


def _member_of(enum_type: type[enum.Enum]) -> BeforeValidator:
    def convert(value: Any) -> Any:
        if isinstance(value, enum_type):
            return value
        if isinstance(value, str):
            try:
                return enum_type(value.lower())
            except ValueError:
                pass
        raise ValueError(f"must be one of {', '.join(m.value for m in enum_type)}")

    return BeforeValidator(convert)


def _field_type(spec: OptionSpec) -> Any:
    if spec.choices is not None and isinstance(spec.kind, type) and issubclass(spec.kind, enum.Enum):
        return Annotated[spec.kind, _member_of(spec.kind)] | None
    if spec.choices is not None:
        return Literal[spec.choices] | None  # type: ignore[valid-type]
    return spec.kind | None


SPECS = option_specs()
SPEC_BY_NAME = {spec.name: spec for spec in SPECS}
EngineOptions: type[BaseModel] = create_model(  # type: ignore[call-overload]
    "EngineOptions",
    __config__=ConfigDict(extra="forbid", strict=True),
    **{spec.name: (_field_type(spec), None) for spec in SPECS},
)


def close_match(key: str, known: list[str]) -> str | None:
    """The known name that means what a mistyped one seems to mean (foreign_flags.similar_name: the same words,
    mistyped at most; never a name that only looks alike), if any."""
    return similar_name(key, known)


def suggestion(key: str, known: list[str]) -> str:
    """' (did you mean 'x'?)', or nothing when no known name is close."""
    close = close_match(key, known)
    return f" (did you mean {close!r}?)" if close else ""


def canonical_value(name: str, value: Any) -> Any:
    """Another spelling of a value as ours: dtype's short names (half, fp16, bf16, fp32), TensorRT-LLM's enum names
    (STATIC_BATCH); anything else unchanged."""
    if name == "dtype" and isinstance(value, str):
        return DTYPE_ALIASES.get(value.lower(), value.lower())
    return enum_value(name, value)


def validate_options(options: Mapping[str, Any], source: str = "") -> dict[str, Any]:
    """The options given, under our names, each of its field's type (enum values as members). TensorRT-LLM's nested
    LLM-API sections (kv_cache_config, scheduler_config) are flattened first. Every problem (unknown name, a name
    given twice, a wrong type) is reported at once in one ConfigError naming the options as the caller spelled
    them, and `source`."""
    flat, problems = flatten_llm_api_options(options)
    spelled: dict[str, str] = {}
    canonical: dict[str, Any] = {}
    for key, value in flat.items():
        name = ALIASES.get(key, key)
        foreign = foreign_option(key) if name not in SPEC_BY_NAME else None
        if foreign is not None and foreign.accepts(value):
            logger.info("option %r = %r asks for what batchserve does anyway: left out", key, value)
        elif foreign is not None:
            problems.append(f"option {foreign.refusal(repr(key))}")
        elif name not in SPEC_BY_NAME:
            problems.append(f"unknown option {key!r}{suggestion(key, [*SPEC_BY_NAME, *ALIASES])}")
        elif name in canonical:
            problems.append(f"option {name!r} given twice: as {spelled[name]!r} and as {key!r}")
        else:
            spelled[name], canonical[name] = key, canonical_value(name, value)
    parsed = None
    try:
        parsed = EngineOptions.model_validate(canonical)
    except ValidationError as exc:
        problems.extend(_type_problems(exc, spelled))
    if problems or parsed is None:
        raise ConfigError(problem_report(problems, source))
    return {name: getattr(parsed, name) for name in canonical}


def _type_problems(exc: ValidationError, spelled: dict[str, str]) -> list[str]:
    """One line per option pydantic refused (its first complaint: a union type lists one per member)."""
    lines: dict[str, str] = {}
    for error in exc.errors():
        name = str(error["loc"][0])
        message = error["msg"].removeprefix("Value error, ")
        lines.setdefault(name, f"option {spelled.get(name, name)!r}: {message}, got {error['input']!r}")
    return list(lines.values())


def problem_report(problems: list[str], source: str = "") -> str:
    """One problem on one line ("SOURCE: ..."); several as a count and one line each."""
    if len(problems) == 1:
        return f"{source}: {problems[0]}" if source else problems[0]
    where = f" in {source}" if source else ""
    return f"{len(problems)} problems{where}:\n" + "\n".join(f"  - {problem}" for problem in problems)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """A JSON or YAML file of options (ours, vLLM's, or a TensorRT-LLM LLM-API file with its nested sections),
    validated (names and types)."""
    try:
        text = Path(path).read_text()
        data = _parse_yaml(text) if Path(path).suffix in (".yaml", ".yml") else json.loads(text)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read config file {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of options")
    return validate_options(data, str(path))


def _parse_yaml(text: str) -> Any:
    import yaml

    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ValueError(str(exc).replace("\n", " ")) from None


def engine_config(options: Mapping[str, Any], source: str = "", file: str | Path | None = None) -> EngineConfig:
    """An EngineConfig from options (over those of a config file, when given), checked by type here and by range by
    the dataclasses; every option out of range is reported at once."""
    merged = read_config_file(file) if file else {}
    merged.update(validate_options(options, source))
    try:
        return EngineConfig.from_options(**merged)
    except ConfigError:
        problems = _range_problems(merged)
        if len(problems) > 1:
            raise ConfigError(problem_report(problems)) from None
        raise


def _range_problems(options: Mapping[str, Any]) -> list[str]:
    """Each option checked alone by the dataclasses (those wrong only together are left to the full check)."""
    problems = []
    for name, value in options.items():
        try:
            EngineConfig.from_options(**{name: value})
        except ConfigError as exc:
            problems.append(str(exc))
    return problems
