"""TensorRT-LLM's LLM-API options (the YAML of `trtllm-serve --extra_llm_api_options`, `LLM(**kwargs)`) flattened
onto our option names: the nested `kv_cache_config` / `scheduler_config` keys become flat ones, TensorRT-LLM's enum
names become our values. engine_options.py checks the result like any other options.

A key with no counterpart here is reported (all of them at once, by engine_options.py); a few keys that only tune
GPU execution and cannot change what this engine computes are dropped with a logged warning, so that a
TensorRT-LLM deployment's file loads unchanged.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

# nested section -> {its key -> our option}; "max_tokens" is converted to blocks (below)
NESTED_KEYS: dict[str, dict[str, str]] = {
    "kv_cache_config": {
        "free_gpu_memory_fraction": "kv_cache_memory_fraction",
        "enable_block_reuse": "enable_prefix_caching",
        "tokens_per_block": "block_size",
        "max_tokens": "num_kv_blocks",
    },
    "scheduler_config": {"capacity_scheduler_policy": "scheduler_policy"},
}
# top-level LLM-API keys whose names differ from ours (max_batch_size, max_num_tokens, max_input_len,
# enable_chunked_prefill, model, tokenizer and dtype are spelled the same)
TOP_LEVEL_KEYS = {"max_seq_len": "max_model_len"}
# TensorRT-LLM's enum names (CapacitySchedulerPolicy) -> our values; the others match ours in any case
ENUM_VALUES = {"scheduler_policy": {"static_batch": "static"}}
# GPU-only execution settings: dropped with a warning (this engine has no CUDA graphs, no overlap scheduler)
# (data_parallel_size and the like are vLLM's names too: foreign_flags.py accepts 1 and refuses the rest, as it
# does for the flags)
IGNORED_KEYS = frozenset(
    {"backend", "cuda_graph_config", "disable_overlap_scheduler", "print_iter_log", "enable_iter_perf_stats"}
)  # fmt: skip
IGNORED_SCHEDULER_VALUES = {"context_chunking_policy": "first_come_first_served"}  # what our chunking does
DEFAULT_BLOCK_SIZE = 16


def flatten_llm_api_options(options: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`options` with TensorRT-LLM's nested sections and names turned into our flat names -> (options, problems).
    Keys outside the nested sections pass through unchanged (engine_options.py knows or refuses them)."""
    flat: dict[str, Any] = {}
    origins: dict[str, str] = {}  # our name -> the key as the caller spelled it
    problems: list[str] = []
    kv_tokens = None
    for key, value in options.items():
        if key in NESTED_KEYS and isinstance(value, Mapping):
            for inner, inner_value in value.items():
                target = NESTED_KEYS[key].get(inner)
                if target == "num_kv_blocks":
                    kv_tokens = inner_value
                elif target is not None:
                    _put(flat, origins, problems, target, inner_value, f"{key}.{inner}")
                elif not _ignored_inner(key, inner, inner_value):
                    known = ", ".join(NESTED_KEYS[key])
                    problems.append(f"unknown option '{key}.{inner}' (this engine reads {known} there)")
        elif key in IGNORED_KEYS:
            logger.warning("option %r is ignored: it tunes GPU execution in TensorRT-LLM, nothing here", key)
        else:
            _put(flat, origins, problems, TOP_LEVEL_KEYS.get(key, key), value, key)
    if kv_tokens is not None:
        if isinstance(kv_tokens, int) and not isinstance(kv_tokens, bool) and kv_tokens > 0:
            block_size = flat.get("block_size", flat.get("tokens_per_block", DEFAULT_BLOCK_SIZE))
            block_size = block_size if isinstance(block_size, int) and block_size > 0 else DEFAULT_BLOCK_SIZE
            _put(
                flat,
                origins,
                problems,
                "num_kv_blocks",
                math.ceil(kv_tokens / block_size),
                "kv_cache_config.max_tokens",
            )
        else:
            problems.append(f"option 'kv_cache_config.max_tokens': must be a positive integer, got {kv_tokens!r}")
    return flat, problems


def _put(
    flat: dict[str, Any], origins: dict[str, str], problems: list[str], name: str, value: Any, spelled: str
) -> None:
    if name in flat:
        problems.append(f"option {name!r} given twice: as {origins[name]!r} and as {spelled!r}")
        return
    flat[name], origins[name] = enum_value(name, value), spelled


def _ignored_inner(section: str, key: str, value: Any) -> bool:
    expected = IGNORED_SCHEDULER_VALUES.get(key) if section == "scheduler_config" else None
    return expected is not None and isinstance(value, str) and value.lower() == expected


def enum_value(name: str, value: Any) -> Any:
    """TensorRT-LLM's spelling of one of our enum values (STATIC_BATCH) as ours; anything else unchanged."""
    aliases = ENUM_VALUES.get(name)
    if aliases and isinstance(value, str):
        return aliases.get(value.lower(), value)
    return value
