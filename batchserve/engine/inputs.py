"""What a prompt may be, and how long: the one validator every front end and the offline API go through."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from batchserve.config import EngineConfig, ModelConfig, Truncation
from batchserve.sampling_params import InvalidRequestError

Prompt = str | list[int] | dict[str, Any]  # text, token ids, or {"prompt": text} / {"prompt_token_ids": ids}


@dataclass(frozen=True)
class EngineLimits:
    """The limits the engine enforces, computed once from its config, the model and the KV pool: every front end
    reports these, never a number of its own."""

    max_model_len: int  # prompt + output tokens of one request
    max_input_len: int  # prompt tokens (after truncation, if any)
    vocab_size: int
    truncation: Truncation
    kv_capacity_tokens: int  # tokens the whole KV pool holds

    @classmethod
    def of(cls, config: EngineConfig, model_config: ModelConfig, kv_capacity_tokens: int) -> EngineLimits:
        """max_model_len is the smallest of the model's context, the configured one and the KV pool's capacity: a
        request longer than the pool could never be scheduled, and would block the queue behind it for ever."""
        scheduler = config.scheduler
        max_model_len = min(
            scheduler.max_model_len or 1 << 30, model_config.max_position_embeddings, kv_capacity_tokens
        )
        max_input_len = min(scheduler.max_input_len or max_model_len - 1, max_model_len - 1)
        if not scheduler.enable_chunked_prefill:  # a prompt must fit in one step
            max_input_len = min(max_input_len, scheduler.max_num_tokens)
        return cls(max_model_len, max_input_len, model_config.vocab_size, scheduler.truncation, kv_capacity_tokens)

    def default_max_tokens(self, prompt_len: int) -> int:
        """What a request without max_tokens may generate: the rest of the context."""
        return max(1, self.max_model_len - min(prompt_len, self.max_input_len))

    def check_token_ids(self, token_ids: Any, what: str = "prompt token ids", param: str = "prompt") -> list[int]:
        """A non-empty list of ints in the vocabulary, or InvalidRequestError."""
        if not isinstance(token_ids, list | tuple) or not token_ids:
            raise InvalidRequestError(f"{what} must be a non-empty list of ints", param)
        vocab = self.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"{what} must be ints in [0, {vocab})", param)
        return list(token_ids)

    def fit_prompt(self, token_ids: list[int]) -> list[int]:
        """The prompt within max_input_len: as is, truncated, or InvalidRequestError (truncation='error')."""
        limit = self.max_input_len
        if len(token_ids) <= limit:
            return token_ids
        if self.truncation == Truncation.LEFT:
            return token_ids[-limit:]
        if self.truncation == Truncation.RIGHT:
            return token_ids[:limit]
        raise InvalidRequestError(
            f"the prompt has {len(token_ids)} tokens, more than the {limit} allowed "
            f"(max_input_len; max_model_len is {self.max_model_len} tokens{self._binding_limit()})",
            "prompt",
        )

    def _binding_limit(self) -> str:
        if self.max_model_len == self.kv_capacity_tokens:
            return f", all the KV cache holds (num_kv_blocks x block_size = {self.kv_capacity_tokens})"
        return ""


def prompt_token_ids(
    prompt: Prompt, tokenizer: PreTrainedTokenizerBase, limits: EngineLimits
) -> tuple[str | None, list[int]]:
    """(prompt text or None, its token ids within the limits); InvalidRequestError for anything else. A dict with
    both "prompt" and "prompt_token_ids" is text a front end has tokenized already."""
    text = None
    if isinstance(prompt, dict):
        text = prompt.get("prompt")
        if text is not None and not isinstance(text, str):
            raise InvalidRequestError("a prompt dict's 'prompt' must be a string", "prompt")
        if "prompt_token_ids" in prompt:
            prompt = prompt["prompt_token_ids"]
            if not isinstance(prompt, list | tuple):
                raise InvalidRequestError("prompt_token_ids must be a non-empty list of ints", "prompt")
        elif text is not None:
            prompt = text
        else:
            raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
    if isinstance(prompt, str):
        ids = list(tokenizer(prompt).input_ids) if prompt else []
        if not ids:
            raise InvalidRequestError("the prompt is empty", "prompt")
        return prompt, limits.fit_prompt(ids)
    if isinstance(prompt, list | tuple):
        if not prompt:
            raise InvalidRequestError("the prompt is empty", "prompt")
        return text, limits.fit_prompt(limits.check_token_ids(prompt))
    raise InvalidRequestError(
        f"a prompt is a string, a list of token ids or a dict, not {type(prompt).__name__}", "prompt"
    )
