"""What a prompt may be, and how long (EngineLimits), and the one builder of an EngineRequest, which checks it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from transformers import PreTrainedTokenizerBase

from batchserve.config import EngineConfig, ModelConfig, Truncation
from batchserve.request import EngineRequest
from batchserve.sampling_params import InvalidRequestError, SamplingParams

Prompt = str | list[int] | dict[str, Any]  # text, token ids, or {"prompt": text} / {"prompt_token_ids": ids}


def check_text(text: str, param: str = "prompt") -> str:
    """The text as given; InvalidRequestError when it holds a lone surrogate (\\ud800, from a JSON escape): not
    Unicode, so no tokenizer can encode it nor any response carry it back."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise InvalidRequestError(
            f"{param} holds a lone surrogate at character {exc.start} (not valid Unicode)", param
        ) from None
    return text


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
        # type() and min/max run in C: a long list is checked at a fraction of a Python loop's cost (and GIL time)
        if not (set(map(type, token_ids)) <= {int} and 0 <= min(token_ids) and max(token_ids) < vocab):
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


@dataclass(frozen=True)
class RequestBuilder:
    """Builds an EngineRequest, the one place where a request's prompt and sampling values are checked: every front
    end (through the serving layer), the offline LLM and a script driving the engine build their requests here."""

    tokenizer: PreTrainedTokenizerBase
    limits: EngineLimits

    def build(
        self,
        request_id: str,
        prompt_token_ids: Any,
        params: SamplingParams | None = None,
        priority: int = 0,
        *,
        prompt: str | None = None,
        arrival_time: float | None = None,
        param: str = "prompt",
    ) -> EngineRequest:
        """A request for token ids (a text's, when `prompt` is that text); InvalidRequestError naming `param` (the
        field the ids came from) for ids out of the vocabulary or over max_input_len with truncation 'error'."""
        params = params or SamplingParams()
        params.validate()
        if params.n != 1:  # an engine request is one sequence; serving/fanout.py runs n choices as n of them
            raise InvalidRequestError(f"this entry point serves n=1 only, got n={params.n}", "n")
        if params.logit_bias:
            self.limits.check_token_ids(list(params.logit_bias), "logit_bias token ids", "logit_bias")
        if params.stop_token_ids:
            self.limits.check_token_ids(params.stop_token_ids, "stop_token_ids", "stop_token_ids")
        if isinstance(prompt_token_ids, list | tuple) and not prompt_token_ids:
            raise InvalidRequestError("the prompt is empty", param)
        token_ids = self.limits.fit_prompt(self.limits.check_token_ids(prompt_token_ids, param=param))
        if arrival_time is None:
            return EngineRequest(request_id, token_ids, params, priority, prompt=prompt)
        return EngineRequest(request_id, token_ids, params, priority, arrival_time, prompt)

    def from_prompt(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams | None = None,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> EngineRequest:
        """As build, for a prompt in any of its forms (tokenized here, on the caller's thread)."""
        text, token_ids = self.tokenized(prompt)
        return self.build(request_id, token_ids, params, priority, prompt=text, arrival_time=arrival_time)

    def tokenized(self, prompt: Prompt) -> tuple[str | None, Any]:
        """(prompt text or None, its token ids, unchecked); InvalidRequestError for a prompt of no known form. A dict
        with both "prompt" and "prompt_token_ids" is text a caller has tokenized already."""
        text = None
        if isinstance(prompt, dict):
            text = prompt.get("prompt")
            if text is not None and not isinstance(text, str):
                raise InvalidRequestError("a prompt dict's 'prompt' must be a string", "prompt")
            if "prompt_token_ids" in prompt:
                return text, prompt["prompt_token_ids"]
            if text is None:
                raise InvalidRequestError("a prompt dict needs 'prompt' or 'prompt_token_ids'", "prompt")
            prompt = text
        if isinstance(prompt, str):
            return prompt, list(self.tokenizer(check_text(prompt)).input_ids) if prompt else []
        if isinstance(prompt, list | tuple):
            return text, prompt
        raise InvalidRequestError(
            f"a prompt is a string, a list of token ids or a dict, not {type(prompt).__name__}", "prompt"
        )
