"""Configuration dataclasses. Validated once, at the edge; the rest of the engine trusts them."""

from __future__ import annotations

import dataclasses
import enum
import importlib.util
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

E = TypeVar("E", bound=enum.StrEnum)


class ConfigError(ValueError):
    """A configuration value that cannot work."""


class SchedulerPolicy(enum.StrEnum):
    MAX_UTILIZATION = "max_utilization"  # fill the budget; preempt when blocks run out
    GUARANTEED_NO_EVICT = "guaranteed_no_evict"  # reserve each request's worst case; never preempt
    STATIC = "static"  # classic static batching: a new batch only when the previous one is done


class SchedulingOrder(enum.StrEnum):
    FCFS = "fcfs"
    PRIORITY = "priority"  # per-request integer, lower first
    SHORTEST_FIRST = "shortest_first"  # prompt + max_tokens, with aging after max_wait_s


class SloAdmission(enum.StrEnum):
    OFF = "off"  # targets are measured (goodput), not acted on
    REFUSE = "refuse"  # a request predicted to miss its TTFT target is refused (503 + Retry-After) or dropped
    DEPRIORITIZE = "deprioritize"  # it is served after every request that can still meet its target


class PreemptionMode(enum.StrEnum):
    RECOMPUTE = "recompute"  # drop the blocks, prefill again later
    SWAP = "swap"  # park the blocks in host memory


class Runner(enum.StrEnum):
    """vLLM's --runner: what a server runs its model for (docs/embeddings.md)."""

    AUTO = "auto"  # pooling when the model folder says so (sentence-transformers modules, a classification head)
    GENERATE = "generate"  # text generation; pooling requests are refused
    POOLING = "pooling"  # embeddings / scores; generation shares the steps where the model has its LM head


class Convert(enum.StrEnum):
    """vLLM's --convert: what a pooling runner computes from the model's last hidden states."""

    AUTO = "auto"  # classify for a *ForSequenceClassification folder, else embed
    EMBED = "embed"  # pooled, normalised hidden states (/v1/embeddings; cosine scores)
    CLASSIFY = "classify"  # a classification head on the last token (/v1/score, /v1/rerank); a causal LM: yes/no logits


class PrefillAttention(enum.StrEnum):
    """How prefill chunks attend on the CPU (layers/attention.py preferred_prefill_method; docs/cpu-kernels.md)."""

    AUTO = "auto"  # sdpa for a bfloat16 pool on a CPU with AMX, else native
    NATIVE = "native"  # the native prefill kernel wherever it takes the chunk
    SDPA = "sdpa"  # torch's fused attention, one call per sequence (on AMX tiles for a bfloat16 pool)
    SPLIT = "split"  # chunks of <= SHORT_PREFILL_MAX_ROWS rows native, batched; longer ones SDPA


class Truncation(enum.StrEnum):
    ERROR = "error"
    LEFT = "left"  # keep the prompt's end
    RIGHT = "right"  # keep the prompt's start


DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
# weights kept quantized (layers/quantization.py): int4 is int4_g32; gguf: a GGUF file's own quantized tensors; auto:
# gguf on a weight-only path where the kernel table's rule records it faster on this CPU, else none
# (engine/auto_quantization.py)
QUANTIZATIONS = ("auto", "none", "int8", "int4", "int4_g32", "int4_g64", "int4_g128", "gguf")
# the KV pool's element type (vLLM's option); auto: the model's dtype; int8 and fp8_e4m3 with per-token-per-head scales
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "int8", "fp8_e4m3")
# how ranks are placed (vLLM's option): mp, one process per rank on this host; ray, actors in a Ray placement group
EXECUTOR_BACKENDS = ("mp", "ray")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def _as_enum(enum_type: type[E], value: object, name: str) -> E:
    """A config value as its enum member; names match case-insensitively (TensorRT-LLM writes GUARANTEED_NO_EVICT)."""
    if isinstance(value, str):
        try:
            return enum_type(value.lower())
        except ValueError:
            pass
    raise ConfigError(f"{name} must be one of {[m.value for m in enum_type]}, got {value!r}")


@dataclass
class SchedulerConfig:
    max_batch_size: int = 64  # sequences in one forward pass
    max_num_tokens: int = 2048  # tokens in one forward pass (prefill chunks + decode tokens)
    scheduler_policy: SchedulerPolicy = SchedulerPolicy.MAX_UTILIZATION
    scheduling_order: SchedulingOrder = SchedulingOrder.FCFS
    max_wait_s: float = 10.0  # shortest_first: a request older than this is served ahead of newer ones
    enable_chunked_prefill: bool = True
    preemption_mode: PreemptionMode = PreemptionMode.RECOMPUTE
    max_model_len: int | None = None  # None: the model's context length
    max_input_len: int | None = None  # None: max_model_len - 1
    truncation: Truncation = Truncation.ERROR  # what to do with a prompt over max_input_len
    max_waiting_requests: int | None = None  # None: unbounded waiting queue
    # static policy: a member that finishes keeps its slot, computed as padding, until the whole batch is done (as
    # a padded batch tensor does in classic static batching); False frees the slot's compute at once
    static_padding: bool = True
    # seconds a served request may take, queued and running, unless it asks for its own `timeout`; None: no limit
    request_timeout: float | None = None
    # long-prompt isolation (vLLM's names): a prompt with more than long_prefill_token_threshold tokens left to
    # compute is long; it gets at most that many tokens a step, and at most max_long_partial_prefills long prompts
    # (max_num_partial_prefills prompts of any length) prefill at once; 0 / None: off
    long_prefill_token_threshold: int = 0
    max_num_partial_prefills: int | None = None
    max_long_partial_prefills: int | None = None
    # service-level targets of requests that give none (docs/slo.md), and what the scheduler does with them
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    slo_admission: SloAdmission = SloAdmission.OFF
    max_preemptions_per_request: int | None = None  # a request preempted this often is never chosen again
    # batch slots kept for requests that cannot wait for another (core/slo.py SlotReserve); None: a quarter of
    # max_batch_size under slo_admission refuse, else 0 (under deprioritize the late requests it serves anyway
    # would take the kept slots: no gain measured)
    slo_reserved_slots: int | None = None

    def validate(self) -> None:
        _require(self.max_batch_size >= 1, "max_batch_size must be >= 1")
        _require(self.request_timeout is None or self.request_timeout > 0, "request_timeout must be > 0")
        _require(self.max_num_tokens >= 1, "max_num_tokens must be >= 1")
        # strings from options, flags or files become members here, once; the engine compares members
        self.scheduler_policy = _as_enum(SchedulerPolicy, self.scheduler_policy, "scheduler_policy")
        self.scheduling_order = _as_enum(SchedulingOrder, self.scheduling_order, "scheduling_order")
        self.preemption_mode = _as_enum(PreemptionMode, self.preemption_mode, "preemption_mode")
        self.truncation = _as_enum(Truncation, self.truncation, "truncation")
        self.slo_admission = _as_enum(SloAdmission, self.slo_admission, "slo_admission")
        self._validate_slo_knobs()
        _require(self.max_wait_s >= 0, "max_wait_s must be >= 0")
        _require(self.max_model_len is None or self.max_model_len >= 2, "max_model_len must be >= 2")
        _require(self.max_input_len is None or self.max_input_len >= 1, "max_input_len must be >= 1")
        _require(
            self.max_waiting_requests is None or self.max_waiting_requests >= 1, "max_waiting_requests must be >= 1"
        )
        if not self.enable_chunked_prefill and self.max_model_len is not None:
            _require(
                self.max_num_tokens >= self.max_model_len,
                "without chunked prefill max_num_tokens must hold a whole prompt (>= max_model_len)",
            )

    def _validate_slo_knobs(self) -> None:
        _require(self.long_prefill_token_threshold >= 0, "long_prefill_token_threshold must be >= 0")
        for name in ("max_num_partial_prefills", "max_long_partial_prefills", "max_preemptions_per_request"):
            _require(getattr(self, name) is None or getattr(self, name) >= 1, f"{name} must be >= 1")
        for name in ("ttft_slo_ms", "tpot_slo_ms"):
            _require(getattr(self, name) is None or getattr(self, name) > 0, f"{name} must be > 0")
        reserved = self.slo_reserved_slots
        _require(reserved is None or 0 <= reserved < self.max_batch_size,
                 "slo_reserved_slots must be >= 0 and less than max_batch_size")  # fmt: skip

    @property
    def reserved_slots(self) -> int:
        """slo_reserved_slots as the scheduler applies it."""
        if self.slo_reserved_slots is not None:
            return self.slo_reserved_slots
        return self.max_batch_size // 4 if self.slo_admission == SloAdmission.REFUSE else 0


@dataclass
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # None: sized from kv_cache_memory_fraction
    kv_cache_memory_fraction: float | None = (
        None  # of memory free after the weights; None: 0.9 GPU, 0.25 CPU (<= 4 GiB)
    )
    enable_prefix_caching: bool = True
    swap_space_gb: float = 1.0  # host memory for swapped-out blocks (preemption_mode="swap")
    num_swap_blocks: int | None = None  # None: sized from swap_space_gb
    kv_cache_dtype: str = "auto"  # KV_CACHE_DTYPES (docs/kv-cache-quantization.md)
    kv_offload_dir: str | None = None  # the disk tier under the pool (docs/kv-offload.md); None: off
    kv_offload_max_bytes: int | None = None  # the tier's byte cap; None: 16 GiB

    def validate(self) -> None:
        _require(8 <= self.block_size <= 128, "block_size must be in [8, 128]")
        _require(self.num_kv_blocks is None or self.num_kv_blocks >= 1, "num_kv_blocks must be >= 1")
        _require(
            self.kv_cache_memory_fraction is None or 0.0 < self.kv_cache_memory_fraction <= 1.0,
            "kv_cache_memory_fraction must be in (0, 1]",
        )
        _require(self.swap_space_gb >= 0, "swap_space_gb must be >= 0")
        _require(self.num_swap_blocks is None or self.num_swap_blocks >= 0, "num_swap_blocks must be >= 0")
        _require(self.kv_cache_dtype in KV_CACHE_DTYPES, f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}")
        _require(
            self.kv_offload_max_bytes is None or self.kv_offload_max_bytes >= 1, "kv_offload_max_bytes must be >= 1"
        )
        _require(
            self.kv_offload_dir is None or os.path.isdir(self.kv_offload_dir),
            f"kv_offload_dir {self.kv_offload_dir!r} is not an existing directory",
        )


@dataclass
class ModelConfig:
    """Shapes of a Llama-family decoder, read from a HF config.json or GGUF metadata."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # HF's rope_scaling dict, its type as rope_type (layers/rotary.py)
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2 has a bias on q/k/v
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)
    architecture: str = "llama"
    sliding_window: int | None = None  # every layer attends to its last W positions only (Mistral)
    qk_norm: bool = False  # an RMSNorm on each q and k head before RoPE (Qwen3)
    rotary_dim: int | None = None  # RoPE on a head's first rotary_dim dims only (partial_rotary_factor); None: all
    hidden_act: str = "silu"
    # mixture of experts (models/moe.py; num_experts 0: every MLP is dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0  # top-k experts a token is routed to
    moe_intermediate_size: int | None = None  # each expert's; None: intermediate_size
    norm_topk_prob: bool = True  # the top-k router weights renormalised to sum 1 (Mixtral always; Qwen3-MoE per config)
    dense_mlp_layers: list[int] = field(default_factory=list)  # layers with a dense MLP of intermediate_size
    extra: dict[str, Any] = field(default_factory=dict)  # what one family reads beyond these (models/gemma.py)

    @property
    def long_context_from(self) -> int | None:
        """LongRoPE's original context: a sequence longer than it is rotated with the long factors throughout
        (core/long_context.py); None for every other RoPE."""
        scaling = self.rope_scaling or {}
        if scaling.get("rope_type", scaling.get("type")) not in ("longrope", "su"):
            return None
        return int(scaling["original_max_position_embeddings"])


SPECULATIVE_METHODS = ("ngram", "suffix", "draft_model")
MAX_SPECULATIVE_TOKENS = 16
K_POLICIES = ("ramp", "cost")


@dataclass
class SpeculativeConfig:
    """vLLM's speculative_config shape (docs/speculative-decoding.md). Speculation switches off once the running
    batch reaches disable_by_batch_size, and k shrinks linearly toward it."""

    method: str = "ngram"
    num_speculative_tokens: int = 4
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 4
    disable_by_batch_size: int = 16
    # below disable_by_batch_size: "ramp" (k shrinks linearly toward it) or "cost" (the k with the most tokens per
    # second by the measured step cost and acceptance, core/speculation_cost.py)
    k_policy: str = "ramp"
    # method "suffix": context depth, finished outputs kept, and the confidence below which a draft stops
    suffix_decoding_max_tree_depth: int = 8
    suffix_decoding_max_cached_requests: int = 64
    suffix_decoding_min_token_prob: float = 0.1
    # method "draft_model": a smaller model with the target's tokenizer (a path, a GGUF file or a hub id, as --model)
    model: str | None = None

    @classmethod
    def from_value(cls, value: SpeculativeConfig | dict | str | None) -> SpeculativeConfig | None:
        if value is None or isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"speculative_config is not JSON: {exc}") from exc
        _require(isinstance(value, dict), "speculative_config must be an object")
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(value) - names
        _require(not unknown, f"speculative_config: unknown key(s) {', '.join(sorted(unknown))}")
        if value.get("model") is not None and "method" not in value:  # vLLM infers the method from a draft model
            value = {**value, "method": "draft_model"}
        config = cls(**value)
        config.validate()
        return config

    def validate(self) -> None:
        _require(
            self.method in SPECULATIVE_METHODS,
            f"speculative_config.method {self.method!r}: one of {SPECULATIVE_METHODS}",
        )
        k = self.num_speculative_tokens
        _require(1 <= k <= MAX_SPECULATIVE_TOKENS, f"num_speculative_tokens {k}: 1 to {MAX_SPECULATIVE_TOKENS}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        _require(1 <= lo <= hi, f"prompt_lookup_min {lo} / prompt_lookup_max {hi}: need 1 <= min <= max")
        _require(self.disable_by_batch_size >= 1, "disable_by_batch_size must be >= 1")
        _require(self.k_policy in K_POLICIES, f"k_policy {self.k_policy!r}: one of {K_POLICIES}")
        _require(self.suffix_decoding_max_tree_depth >= 1, "suffix_decoding_max_tree_depth must be >= 1")
        _require(self.suffix_decoding_max_cached_requests >= 0, "suffix_decoding_max_cached_requests must be >= 0")
        _require(0.0 <= self.suffix_decoding_min_token_prob <= 1.0, "suffix_decoding_min_token_prob: 0 to 1")
        drafts_by_model = self.method == "draft_model"
        _require(drafts_by_model == (self.model is not None), "speculative_config.model: needed by method "
                 f"draft_model and by it only (method {self.method!r}, model {self.model!r})")  # fmt: skip


@dataclass
class EngineConfig:
    model: str | None = None  # HF directory, .gguf file, or None for the default SmolLM2
    tokenizer: str | None = None  # None: from the model
    dtype: str = "auto"  # bfloat16 where the device has bf16 matmul units, else float32
    device: str = "auto"
    seed: int = 0
    num_threads: int | None = None  # torch intra-op threads on CPU; None: torch's default
    record_steps: bool = False  # keep a StepRecord per engine step (for traces and timelines)
    enforce_eager: bool = False  # vLLM's name: no CUDA graphs, every step runs eagerly (worker/cuda_graphs.py)
    # a request's tokens do not depend on what shares its batch: one reduction order per row (docs/determinism.md)
    deterministic: bool = False
    quantization: str = "auto"  # vLLM's name: weights kept quantized on the CPU (docs/quantization.md)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    # speculative decoding (vLLM's shape: a dict or JSON string is accepted); None: off
    speculative_config: dict | None = None
    runner: Runner = Runner.AUTO  # vLLM's: generate or pooling (auto: from the model folder); resolved at load
    convert: Convert = Convert.AUTO  # vLLM's: a pooling runner's task, embed or classify; resolved at load
    # how prompts attend on the CPU (layers/attention.py); BATCHSERVE_PREFILL_ATTENTION overrides it
    prefill_attention: PrefillAttention = PrefillAttention.AUTO
    # LoRA adapters (vLLM's names; docs/lora.md): requests name one by `model`; lora_modules "name=path ..." loads
    # some at start; max_loras distinct adapters run in one step, max_cpu_loras stay loaded (LRU beyond)
    enable_lora: bool = False
    lora_modules: str | None = None
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    # POST /v1/load_lora_adapter and /v1/unload_lora_adapter answered (vLLM: VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updating: bool = False
    # ranks the model is split over (docs/parallelism.md): tensor-parallel ranks each hold a shard of every layer;
    # "mp": one process per rank on this host; "ray": ranks 1.. as actors of a Ray placement group
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # a step's decode rows split in this many micro-batches in flight through the stages; 1: off (the default: on
    # the CPU a decode micro-batch streams its stage's weights as the whole batch does, docs/parallelism.md)
    pipeline_micro_batches: int = 1
    distributed_executor_backend: str = "mp"

    def validate(self) -> None:
        SpeculativeConfig.from_value(self.speculative_config)  # refuses a bad one here, with the reason
        self.runner = _as_enum(Runner, self.runner, "runner")
        self.convert = _as_enum(Convert, self.convert, "convert")
        self.prefill_attention = _as_enum(PrefillAttention, self.prefill_attention, "prefill_attention")
        _require(self.dtype in DTYPES, f"dtype must be one of {DTYPES}")
        _require(self.device in DEVICES, f"device must be one of {DEVICES}")
        _require(self.quantization in QUANTIZATIONS, f"quantization must be one of {QUANTIZATIONS}")
        _require(self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        _require(
            self.pipeline_parallel_size >= 1, f"pipeline_parallel_size must be >= 1, got {self.pipeline_parallel_size}"
        )
        micro = self.pipeline_micro_batches
        _require(micro >= 1, f"pipeline_micro_batches must be >= 1, got {micro}")
        _require(
            self.distributed_executor_backend in EXECUTOR_BACKENDS,
            f"distributed_executor_backend must be one of {EXECUTOR_BACKENDS}, got {self.distributed_executor_backend!r}",
        )
        _require(
            self.distributed_executor_backend != "ray" or importlib.util.find_spec("ray") is not None,
            "distributed_executor_backend ray needs the ray package: pip install 'batchserve[distributed]'",
        )
        self.scheduler.validate()
        self.cache.validate()
        self._validate_lora()

    def _validate_lora(self) -> None:
        _require(self.max_loras >= 1, f"max_loras must be at least 1, got {self.max_loras}")
        _require(1 <= self.max_lora_rank <= 512, f"max_lora_rank must be 1 to 512, got {self.max_lora_rank}")
        cpu = self.max_cpu_loras
        _require(cpu is None or cpu >= self.max_loras,
                 f"max_cpu_loras ({cpu}) must be at least max_loras ({self.max_loras})")  # fmt: skip
        modules = parse_lora_modules(self.lora_modules)
        _require(not modules or self.enable_lora, "lora_modules needs enable_lora")

    @property
    def cpu_loras(self) -> int:
        """Adapters kept loaded in host memory."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @classmethod
    def from_options(cls, **options: Any) -> EngineConfig:
        """Build from flat keyword options (LLM(...), CLI flags, a JSON config file); unknown keys are an error."""
        options = {ALIASES.get(key, key): value for key, value in options.items()}
        engine_keys = {f.name for f in dataclasses.fields(cls)} - {"scheduler", "cache"}
        scheduler_keys = {f.name for f in dataclasses.fields(SchedulerConfig)}
        cache_keys = {f.name for f in dataclasses.fields(CacheConfig)}
        unknown = set(options) - engine_keys - scheduler_keys - cache_keys
        _require(not unknown, f"unknown option(s): {', '.join(sorted(unknown))}")
        config = cls(
            **{k: v for k, v in options.items() if k in engine_keys},
            scheduler=SchedulerConfig(**{k: v for k, v in options.items() if k in scheduler_keys}),
            cache=CacheConfig(**{k: v for k, v in options.items() if k in cache_keys}),
        )
        config.validate()
        return config

    @classmethod
    def from_json_file(cls, path: str | Path, **overrides: Any) -> EngineConfig:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read config file {path}: {exc}") from exc
        _require(isinstance(data, dict), f"config file {path} must hold a JSON object")
        data = {ALIASES.get(key, key): value for key, value in data.items()}
        data.update({ALIASES.get(key, key): value for key, value in overrides.items()})
        return cls.from_options(**data)

    def to_flat_dict(self) -> dict[str, Any]:
        flat = {k: v for k, v in dataclasses.asdict(self).items() if k not in ("scheduler", "cache")}
        flat.update(dataclasses.asdict(self.scheduler))
        flat.update(dataclasses.asdict(self.cache))
        return flat


def parse_lora_modules(text: str | None) -> dict[str, str]:
    """--lora-modules "name=path name2=path2" (spaces or commas between pairs) -> {name: path}."""
    modules: dict[str, str] = {}
    for pair in (text or "").replace(",", " ").split():
        name, sep, path = pair.partition("=")
        _require(bool(sep and name and path), f"lora_modules: {pair!r} is not name=path")
        _require(name not in modules, f"lora_modules: adapter name {name!r} given twice")
        modules[name] = path
    return modules


# Names TensorRT-LLM users know (its config files' keys), mapped onto ours.
TRTLLM_ALIASES = {
    "kv_cache_free_gpu_memory_fraction": "kv_cache_memory_fraction",
    "enable_kv_cache_reuse": "enable_prefix_caching",
    "kv_cache_reuse": "enable_prefix_caching",
    "tokens_per_block": "block_size",
    "tp_size": "tensor_parallel_size",
    "pp_size": "pipeline_parallel_size",
}
# vLLM's engine arguments (flags and keys). Its gpu_memory_utilization bounds weights and KV together, ours the KV
# pool's share of the memory left after the weights: the same knob, measured from a different base.
VLLM_ALIASES = {
    "max_num_seqs": "max_batch_size",
    "max_num_batched_tokens": "max_num_tokens",
    "gpu_memory_utilization": "kv_cache_memory_fraction",
    "num_gpu_blocks_override": "num_kv_blocks",
    "swap_space": "swap_space_gb",
}
ALIASES = TRTLLM_ALIASES | VLLM_ALIASES
