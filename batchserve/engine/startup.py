"""The engine's start-up: resolve device and dtype, load the model's config, weights and tokenizer, build the runner.

torch, the model and transformers are imported when `load_runner` is called, not with this module: an engine given
its own runner (tests, fakes) never imports them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

from batchserve import modes
from batchserve.config import EngineConfig, ModelConfig, SpeculativeConfig
from batchserve.engine.auto_quantization import resolve_quantization

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    from batchserve.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def load_runner(
    config: EngineConfig, initial_kv_blocks: int | None = None
) -> tuple[ModelRunner, ModelConfig, PreTrainedTokenizerBase]:
    """Load `config.model` (default: SmolLM2-135M-Instruct) on the configured device and dtype
    -> (runner, model_config, tokenizer). The KV pool: see ModelRunner (`initial_kv_blocks` for one that grows)."""
    from batchserve.layers import kernels
    from batchserve.layers.linear import deterministic_gemm_path, engine_layouts, gemm_path, keeps_one_bf16_copy
    from batchserve.layers.quantization import quantized_linears
    from batchserve.models.loader import (
        is_gguf,
        load_model,
        load_model_config,
        load_tokenizer,
        resolve_model_path,
        tokenizer_folder,
    )
    from batchserve.worker.device import resolve_device, resolve_dtype
    from batchserve.worker.model_runner import ModelRunner

    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    config.dtype = str(dtype).removeprefix("torch.")  # the effective value, as logs and /v1/models report it
    path = resolve_model_path(config.model)
    model_config = load_model_config(path)
    model_config, pooling = pooling_setup(config, path, model_config)
    logger.info("loading %s (%s) on %s as %s", path, model_config.architecture, device, dtype)
    native_kernels = device.type == "cpu" and kernels.load() is not None
    if device.type == "cpu":
        logger.info("CPU path: %s; native kernels %s", gemm_path(dtype), "on" if native_kernels else "off")
    auto = resolve_quantization(config, path, model_config, device.type, config.dtype)
    # the one place that decides which combination of modes runs, before anything is allocated (batchserve/modes.py)
    facts = modes.ModeFacts.of(config, model_config, device.type, config.dtype, native_kernels, is_gguf(path))
    facts = dataclasses.replace(facts, quantization_auto=auto is not None)
    decision = modes.enforce(config, facts)
    if config.deterministic and device.type == "cpu":
        logger.info(
            "deterministic mode: GEMMs: %s; attention: every row by the decode kernel in 16-token tiles of the pool's "
            "blocks (prefill chunks too); logits in float32",
            deterministic_gemm_path(dtype),
        )
    if config.quantization != "none":
        logger.info("weights kept quantized: %s (docs/quantization.md)", config.quantization)
    weights = available = 0  # quantized weights: the memory rule of the bf16 layouts does not count them
    if config.quantization == "none":  # quantized weights are smaller than this count
        weights, available = check_memory_before_loading(config, path, model_config, dtype, device)
    speculating = config.speculative_config is not None
    one_bf16_copy = device.type == "cpu" and keeps_one_bf16_copy(weights, available, dtype, speculating)
    split = config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1
    gemm_path = None if auto is None else auto.quant_gemm_path  # auto's weight-only path; else the table's
    if not split:  # the weights first: a GGUF file's own refusals come before its tokenizer's conversion
        rows = config.scheduler.max_num_tokens
        layouts = engine_layouts(config.deterministic, rows, one_bf16_copy)
        with layouts, quantized_linears(config.quantization, dtype, gemm_path):
            model = load_model(path, model_config, dtype, device)
    tokenizer = load_tokenizer(path, config.tokenizer)
    config.tokenizer = str(tokenizer_folder(path, config.tokenizer))  # the effective value, as the logs report it
    logger.info("tokenizer from %s (a Hugging Face folder other tools can load too)", config.tokenizer)
    if split:  # the ranks load their shards themselves, given the effective tokenizer folder
        runner = _parallel_runner(config, model_config, initial_kv_blocks)
    else:
        runner = ModelRunner(config, model_config, model, device, dtype, initial_kv_blocks)
    runner.structured_outputs.tokenizer = tokenizer
    runner.modes = decision
    if pooling is not None:
        runner.pooler = pooling(tokenizer)
    if config.enable_lora:
        from batchserve.worker.lora_slots import LoRAPool

        lora_config = (config.max_loras, config.max_lora_rank, config.cpu_loras)
        runner.lora = LoRAPool(model, model_config, *lora_config, dtype, device)
    speculative = SpeculativeConfig.from_value(config.speculative_config)
    if speculative is not None and speculative.method == "draft_model":
        runner.draft = load_draft_model(config, speculative.model, runner, tokenizer)
    return runner, model_config, tokenizer


def _parallel_runner(config: EngineConfig, model_config: ModelConfig, initial_kv_blocks: int | None):
    """Rank 0 here, the other ranks in processes of their own (worker/parallel_executor.py); a size the model's
    shapes cannot split is refused first, naming both numbers."""
    from batchserve.models.sharding import check_pipeline_parallel, check_tensor_parallel
    from batchserve.worker.parallel_executor import start_tensor_parallel

    check_tensor_parallel(model_config, config.tensor_parallel_size)
    check_pipeline_parallel(model_config, config.pipeline_parallel_size)
    return start_tensor_parallel(config, model_config, initial_kv_blocks)


def load_draft_model(config: EngineConfig, name: str, target: ModelRunner, tokenizer: PreTrainedTokenizerBase):
    """The draft model of speculative method draft_model, in a runner of its own whose KV pool has as many blocks as
    the target's (it holds the same sequences). A draft model of another tokenizer is refused: its token ids would
    mean other text."""
    from batchserve.layers.linear import engine_layouts
    from batchserve.models.loader import load_model, load_model_config, load_tokenizer, resolve_model_path
    from batchserve.models.registry import ModelLoadError
    from batchserve.worker.draft_model import DraftModelProposer
    from batchserve.worker.model_runner import ModelRunner

    path = resolve_model_path(name)
    draft_tokenizer = load_tokenizer(path, None)
    if draft_tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ModelLoadError(
            f"the draft model {path} has another tokenizer than the target's ({len(draft_tokenizer.get_vocab())} "
            f"vs {len(tokenizer.get_vocab())} tokens, or the same count with other ids): its drafts would be other text"
        )
    draft_config = load_model_config(path)
    logger.info("draft model %s (%s) for speculative decoding", path, draft_config.architecture)
    with engine_layouts(config.deterministic, config.scheduler.max_num_tokens):
        model = load_model(path, draft_config, target.dtype, target.device)
    cache = dataclasses.replace(config.cache, num_kv_blocks=target.num_kv_blocks, enable_prefix_caching=True)
    scheduler = dataclasses.replace(config.scheduler, preemption_mode="recompute")  # its pool is never swapped
    own = dataclasses.replace(config, cache=cache, scheduler=scheduler, speculative_config=None)
    runner = ModelRunner(own, draft_config, model, target.device, target.dtype)
    return DraftModelProposer(runner, target.model_config.vocab_size)


def check_memory_before_loading(config: EngineConfig, path, model_config, dtype, device) -> tuple[int, int]:
    """Weights (from the checkpoint's headers, at the load dtype) + the smallest KV pool against the memory free now
    (host/memory.py): a model that cannot fit is refused before anything is allocated -> (weight bytes, memory free
    bytes)."""
    from batchserve.host.memory import available_memory_bytes, min_kv_blocks, require_memory_for
    from batchserve.models.gguf_weights import checkpoint_weight_bytes
    from batchserve.models.loader import gguf_cache_dir, gguf_reader, gguf_to_hf_name, is_gguf
    from batchserve.worker.kv_cache import block_bytes, pool_dtype

    converted = gguf_cache_dir(path) if is_gguf(path) else path
    if is_gguf(path) and (converted / "model_config.json").is_file():  # its safetensors header: no GGUF parse
        weights = checkpoint_weight_bytes(converted, gguf_to_hf_name, dtype)
    else:
        reader = gguf_reader(path) if is_gguf(path) else None  # the conversion parses it next anyway
        weights = checkpoint_weight_bytes(path, gguf_to_hf_name, dtype, reader)
    cache = config.cache
    blocks = min_kv_blocks(cache.num_kv_blocks, config.scheduler.max_model_len, cache.block_size)
    kv = blocks * block_bytes(model_config, cache.block_size, pool_dtype(cache, dtype))
    available = available_memory_bytes(device)
    require_memory_for(weights, kv, available)
    return weights, available


def pooling_setup(config: EngineConfig, path, model_config: ModelConfig):
    """The runner and task resolved from the folder (worker/pooling_model.py); for a pooling runner, the model config
    to load and a factory of its Pooler (it needs the tokenizer, loaded later); None for a generation runner."""
    from batchserve.config import Runner
    from batchserve.worker.pooler import Pooler
    from batchserve.worker.pooling_model import pooler_config, pooling_model_config, resolve_runner

    resolve_runner(config, path)
    if config.runner != Runner.POOLING:
        return model_config, None
    model_config, generates = pooling_model_config(path, model_config)
    logger.info("pooling runner: %s%s", config.convert, "" if generates else " (no LM head: no generation)")
    return model_config, lambda tokenizer: Pooler(pooler_config(path, config, generates, tokenizer))
