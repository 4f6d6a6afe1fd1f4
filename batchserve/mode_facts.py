"""What the mode table (batchserve/modes.py) reads: the options as the engine resolved them, the model's traits and
the host's, in one frozen dataclass. Torch-free, beside config.py."""

from __future__ import annotations

from dataclasses import dataclass

from batchserve.config import EngineConfig, ModelConfig, SpeculativeConfig

QUANTIZED_WEIGHTS = ("int8", "int4", "int4_g32", "int4_g64", "int4_g128", "gguf")


@dataclass(frozen=True)
class ModeFacts:
    """What the rules read: the options as the engine resolved them, the model's traits and the host's. A test builds
    one by hand; the engine builds it with `of`."""

    device: str = "cpu"  # "cpu" or "cuda"
    dtype: str = "float32"  # resolved: float32, bfloat16, float16
    quantization: str = "none"  # resolved: quantization auto is decided before the table (engine/auto_quantization.py)
    quantization_auto: bool = False  # it was auto, the default
    kv_cache_dtype: str = "auto"
    deterministic: bool = False
    speculative_method: str | None = None  # None: speculation off
    scheduler_policy: str = "max_utilization"
    enforce_eager: bool = False
    windowed: bool = False  # some attention layer sees only its last W positions (Mistral, Qwen, Phi-3, Gemma)
    softcapped: bool = False  # attention scores or logits soft-capped by tanh (Gemma 2)
    moe: bool = False  # a mixture-of-experts MLP
    gguf_file: bool | None = None  # the model is a .gguf file; None: unknown (an engine given its own runner)
    native_kernels: bool = True  # the native CPU kernels are built and loaded
    kv_offload: bool = False  # the disk KV tier is on (kv_offload_dir)
    prefix_caching: bool = True
    lora: bool = False  # enable_lora: requests may run with LoRA adapters
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    executor_backend: str = "mp"  # distributed_executor_backend
    slo_reserved_slots: int = 0  # batch slots kept for requests that cannot wait (as the scheduler applies it)

    @classmethod
    def of(
        cls,
        config: EngineConfig,
        model: ModelConfig | None,
        device: str,
        dtype: str,
        native_kernels: bool,
        gguf_file: bool | None = None,
    ) -> ModeFacts:
        speculative = SpeculativeConfig.from_value(config.speculative_config)
        traits = model_traits(model) if model is not None else {}
        return cls(
            device=device,
            dtype=dtype,
            quantization=config.quantization,
            kv_cache_dtype=config.cache.kv_cache_dtype,
            deterministic=config.deterministic,
            speculative_method=None if speculative is None else speculative.method,
            scheduler_policy=str(config.scheduler.scheduler_policy),
            enforce_eager=config.enforce_eager,
            gguf_file=gguf_file,
            native_kernels=native_kernels,
            kv_offload=config.cache.kv_offload_dir is not None,
            prefix_caching=config.cache.enable_prefix_caching,
            lora=config.enable_lora,
            tensor_parallel_size=config.tensor_parallel_size,
            pipeline_parallel_size=config.pipeline_parallel_size,
            executor_backend=config.distributed_executor_backend,
            slo_reserved_slots=config.scheduler.reserved_slots,
            **traits,
        )

    @property
    def kv_pool_dtype(self) -> str:
        return self.dtype if self.kv_cache_dtype == "auto" else self.kv_cache_dtype


def model_traits(model: ModelConfig) -> dict[str, bool]:
    """The model's traits the rules read, from its config alone (before any weight is loaded): the same fields the
    families' layers read to window, soft-cap or route (models/llama.py, gemma.py, moe.py)."""
    extra = model.extra
    windowed = (
        model.sliding_window is not None or bool(extra.get("windowed_layers")) or bool(extra.get("sliding_window"))
    )
    softcapped = extra.get("attn_softcap") is not None or extra.get("final_softcap") is not None
    return {"windowed": windowed, "softcapped": softcapped, "moe": model.num_experts > 0}
