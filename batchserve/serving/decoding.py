"""Decoding a long id list without holding the GIL: a fast tokenizer's `decode` runs its Rust core with the GIL
held (a worker thread would still stall the event loop for the whole call), while `decode_batch` releases it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def decode_releasing_gil(tokenizer: Any, token_ids: Sequence[int]) -> str:
    """`tokenizer.decode(token_ids)`, through the Rust core's GIL-free batch call when the result is the same (a
    fast tokenizer that does no Python-side clean-up of spaces); otherwise `decode` itself."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if (
        backend is None
        or not hasattr(backend, "decode_batch")
        or getattr(tokenizer, "clean_up_tokenization_spaces", True)
    ):
        return tokenizer.decode(token_ids)
    return backend.decode_batch([list(token_ids)], skip_special_tokens=False)[0]
