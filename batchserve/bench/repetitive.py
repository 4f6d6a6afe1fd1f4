"""Workloads whose answers repeat their prompts, where speculative decoding pays: code-edit, extract-json,
summarize-quote, multi-turn (docs/speculative-decoding.md).

The prompts are chat conversations made from text that ships with the package: the source of two of its modules (code)
and the benchmark corpus's paragraphs (prose). Unlike the synthetic workloads, a request stops at its end-of-sequence
token (output_len is a cap), since what is measured is how much of a natural answer the drafts predict.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from batchserve.bench.corpus import CORPUS
from batchserve.serving.chat import chat_prompt_ids

REPETITIVE_WORKLOADS = ("code-edit", "extract-json", "summarize-quote", "multi-turn")
DEFAULT_OUTPUT_LEN = 128
_PACKAGE = Path(__file__).resolve().parent.parent
_CODE_SOURCES = ("core/kv_cache_manager.py", "worker/sampler.py")

Conversation = list[dict[str, str]]


def _functions(relative_path: str) -> list[str]:
    """Top-level functions and classes of a module of this package, short enough to be a prompt."""
    source = (_PACKAGE / relative_path).read_text()
    blocks = source.split("\n\n\n")
    return [b.strip() for b in blocks if b.lstrip().startswith(("def ", "class ")) and len(b) < 1500]


def _paragraphs() -> list[str]:
    return [" ".join(p.split()) for p in CORPUS.split("\n\n") if len(p.strip()) > 200]


def _cycle(items: list[str], count: int) -> list[str]:
    return [items[i % len(items)] for i in range(count)]


def _user(text: str) -> Conversation:
    return [{"role": "user", "content": text}]


def conversations(name: str, count: int) -> list[Conversation]:
    """`count` conversations of workload `name` (texts reused in turn when there are fewer than `count`)."""
    if name not in REPETITIVE_WORKLOADS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(REPETITIVE_WORKLOADS)}")
    if name == "code-edit":
        code = [f for path in _CODE_SOURCES for f in _functions(path)]
        return [_user(f"Add type hints and keep everything else identical. Output only the code.\n\n{c}")
                for c in _cycle(code, count)]  # fmt: skip
    prose = _cycle(_paragraphs(), count)
    if name == "extract-json":
        ask = 'From this text, output a JSON object with keys "subject" and "quote" (the first sentence, verbatim).'
        return [_user(f"{ask}\n\n{p}") for p in prose]
    if name == "summarize-quote":
        return [_user(f"Summarize this text by quoting its two most important sentences word for word.\n\n{p}")
                for p in prose]  # fmt: skip
    return [
        _user(f"Explain this briefly.\n\n{p}")
        + [{"role": "assistant", "content": p}, {"role": "user", "content": "Repeat your answer exactly, then add one line."}]
        for p in prose
    ]  # fmt: skip


def prompt_ids(tokenizer: Any, conversation: Conversation) -> list[int]:
    """The conversation through the tokenizer's chat template (generation prompt added); a tokenizer without one (a
    test's) gets the turns' contents joined."""
    if getattr(tokenizer, "chat_template", None):
        return chat_prompt_ids(tokenizer, conversation)
    return list(tokenizer.encode("\n\n".join(turn["content"] for turn in conversation)))
