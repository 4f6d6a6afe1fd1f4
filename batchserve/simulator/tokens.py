"""The tokenizer that cuts the workload's prompts. Lengths are exact whatever it is; the model's own keeps a
simulated workload identical to `bench`'s for the same seed (same prompts, same output lengths)."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class ByteTokenizer:
    """One token per UTF-8 byte: the fallback when no model tokenizer is at hand (an analytic profile's model)."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode())

    def decode(self, ids: list[int]) -> str:
        return bytes(i % 256 for i in ids).decode(errors="replace")


def workload_tokenizer(model: str | None, tokenizer: str | None) -> Any:
    """--tokenizer, else the model's (the default SmolLM2 when no --model), else bytes."""
    try:
        from batchserve.models.loader import load_tokenizer, resolve_model_path

        if tokenizer:
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(tokenizer)
        return load_tokenizer(resolve_model_path(model))
    except Exception as exc:  # noqa: BLE001 - no tokenizer is not fatal here: lengths stay exact with bytes
        logger.warning("no tokenizer for %s (%s); prompts are cut from bytes", model or "the default model", exc)
        return ByteTokenizer()
