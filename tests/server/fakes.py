"""A model-free LLMEngine for fast server tests: tests/doubles.py's real engine over the FakeRunner and the byte-level
tokenizer, with server-sized defaults (a few ms per step, so streams and queues are observable)."""

from __future__ import annotations

from typing import Any

from batchserve.engine.llm_engine import LLMEngine
from tests.doubles import byte_tokenizer, make_engine

__all__ = ["byte_tokenizer", "fake_engine"]


def fake_engine(delay_s: float = 0.005, num_kv_blocks: int = 256, **options: Any) -> LLMEngine:
    """`engine.runner.crash.set()` makes its next step fail like a lost device."""
    options = {"max_model_len": 256, "max_batch_size": 8, "block_size": 16, "num_swap_blocks": 0} | options
    return make_engine(delay_s=delay_s, num_kv_blocks=num_kv_blocks, **options)
