"""LongRoPE (Phi-3/3.5, Phi-4-mini) switches a whole sequence from its short to its long RoPE factors once the
sequence outgrows the original context: transformers rotates every token of such a sequence with the long factors,
and recomputes a generation that crosses that length from scratch (Phi3ForCausalLM.prepare_inputs_for_generation).
The scheduler does the same: a sequence longer than the original context is computed "long" from its first token
(the worker rotates its tokens with the long factors), and one that crosses it while running starts over. Its blocks
are found in the prefix cache only by other long sequences: their content differs from a short sequence's."""

from __future__ import annotations

from batchserve.core.kv_cache_manager import KVCacheManager
from batchserve.request import Request

LONG_CONTEXT_SALT = 0x4C6F6E67  # the first block's parent in the prefix-cache keys of long sequences


def mark_if_long(request: Request, original_length: int | None) -> None:
    """Before a request's first token is computed (admission, or a start-over)."""
    if original_length is not None and request.num_tokens > original_length:
        request.cache_salt = LONG_CONTEXT_SALT


def outgrew_short_context(request: Request, original_length: int | None) -> bool:
    """A sequence computed with the short factors that now holds more tokens than the original context."""
    return original_length is not None and request.cache_salt is None and request.num_tokens > original_length


def start_over(request: Request, kv: KVCacheManager, original_length: int | None) -> None:
    """Drop what a sequence computed with the short factors; it is scheduled anew and computed long."""
    kv.free(request)
    request.num_computed_tokens = 0
    mark_if_long(request, original_length)


def draft_room(request: Request, original_length: int | None, max_model_len: int) -> int:
    """The model length speculation may fill: drafts of a short sequence stop at the original context (a position past
    it is computed long, after the start-over)."""
    if original_length is not None and request.num_tokens <= original_length:
        return min(max_model_len, original_length + 1)
    return max_model_len
