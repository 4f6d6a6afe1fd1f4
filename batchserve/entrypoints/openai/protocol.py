"""Pydantic models of the OpenAI-compatible API: request bodies (validated at the edge) and response shapes."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator
from pydantic_core import PydanticCustomError

from batchserve.sampling_params import (
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_STOP_TOKEN_IDS,
    InvalidRequestError,
    SamplingParams,
    StructuredOutputsParams,
)
from batchserve.serving.chat import message_shape_error
from batchserve.serving.results import Usage
from batchserve.serving.structured import constraint_of

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
# Any token array of a body (a prompt, /detokenize's tokens): longer than any context this server runs, and parsed
# before the engine can say so (docs/limits.md).
MAX_TOKEN_IDS = 1 << 18


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class RequestBody(BaseModel):
    """A request body: values of the wrong JSON type are refused ("4" is not 4, "yes" is not true), and so are
    unknown fields: a field the server does not act on is answered 400 naming it, never silently dropped (the
    server's --lenient turns that into a logged warning, front.py)."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(RequestBody):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(RequestBody):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI's, plus vLLM's sampling extras)."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    # bounded here, so a huge list is refused by its length before any element is validated
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None  # an end-user id for the caller's own monitoring: it changes nothing computed
    priority: int = 0  # lower is served first under scheduling_order="priority"
    timeout: float | None = None  # seconds this request may take, waiting and running (else --request-timeout)
    # service-level targets and queue deadline (docs/slo.md): numbers, checked by SamplingParams (> 0, not past)
    ttft_slo_ms: float | None = None
    tpot_slo_ms: float | None = None
    deadline: float | None = None  # Unix seconds
    # KV retention by token range (batchserve/kv_retention.py: TensorRT-LLM's KvCacheRetentionConfig shape; its field
    # names token_range_retention_configs and duration_ms are read too); checked by SamplingParams, 400 naming the field
    kv_retention: dict[str, Any] | None = None
    # token id (a JSON key, so a string) -> bias added to its logit
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS_ENTRIES)
    # structured outputs: OpenAI's response_format, vLLM's guided_* fields and its newer structured_outputs object
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: dict[str, Any] | None = None

    @field_validator("response_format")
    @classmethod
    def _response_format_has_type(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and not isinstance(value.get("type"), str):
            raise PydanticCustomError("missing_type", "response_format needs a string `type`")
        return value

    # the constraint once computed: a large body's is computed in the body parser process (its JSON Schema check
    # takes seconds a megabyte) and travels back with the request
    _constraint: tuple[StructuredOutputsParams | None] | None = PrivateAttr(None)

    def constraint(self) -> StructuredOutputsParams | None:
        if self._constraint is None:
            guided = {name: getattr(self, name) for name in GUIDED_FIELDS}
            self._constraint = (constraint_of(self.response_format, guided, self.structured_outputs),)
        return self._constraint[0]

    def check_off_loop(self) -> None:
        """The checks worth running where the body was parsed off the event loop (bodies.py)."""
        self.constraint()

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """Raises InvalidRequestError for values the engine cannot serve."""
        options: dict[str, Any] = {
            "max_tokens": max_tokens,
            "seed": self.seed,
            "stop": self.stop if self.stop is not None else [],
            "stop_token_ids": self.stop_token_ids or [],
            "ignore_eos": self.ignore_eos,
            "min_tokens": self.min_tokens,
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "n": self.n,
            "logprobs": logprobs,
            "logit_bias": _token_id_keys(self.logit_bias),
            "structured_outputs": self.constraint(),
        }
        for name in (
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "repetition_penalty",
            "presence_penalty",
            "frequency_penalty",
            "ttft_slo_ms",
            "tpot_slo_ms",
            "deadline",
            "kv_retention",
        ):
            value = getattr(self, name)
            if value is not None:
                options[name] = value
        return SamplingParams(**options)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


def _token_id_keys(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias keys are token ids written as JSON strings."""
    if bias is None:
        return None
    # strictly ASCII digits: Python's int() also reads "1_0", " 1", "+1" and other scripts' digits
    bad = next((key for key in bias if not (key.isascii() and key.isdigit() and len(key) <= 10)), None)
    if bad is not None:
        raise InvalidRequestError(f"logit_bias keys must be token ids (decimal digits), got {bad!r}", "logit_bias")
    return {int(key): value for key, value in bias.items()}


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = 16  # OpenAI's default for completions
    echo: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None  # vLLM's: the prompt's scores by position, with this many alternatives
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt")
    @classmethod
    def _token_arrays_bounded(cls, prompt: Any) -> Any:
        arrays = [prompt] if prompt and isinstance(prompt[0], int) else prompt if isinstance(prompt, list) else []
        if sum(len(a) for a in arrays if isinstance(a, list)) > MAX_TOKEN_IDS:
            raise PydanticCustomError("too_long", "at most {limit} prompt token ids", {"limit": MAX_TOKEN_IDS})
        return prompt


class TextContentPart(RequestBody):
    type: Literal["text"]
    text: str


class ChatMessage(RequestBody):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None  # given to the chat template, for templates that name participants
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls, in a conversation's history
    tool_call_id: str | None = None  # a tool message: the call it answers
    reasoning_content: str | None = None  # an assistant turn's thinking (not sent back to the template)

    @field_validator("content", mode="before")
    @classmethod
    def _text_parts_only(cls, content: Any) -> Any:
        """An image or audio part is refused in words a user reads, not as a failed match of every union member."""
        for part in content if isinstance(content, list) else ():
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise PydanticCustomError(
                    "unsupported_content",
                    "only text content parts are supported; this model cannot read a part of type {kind}",
                    {"kind": repr(kind)},
                )
        return content

    @model_validator(mode="after")
    def _shape(self) -> ChatMessage:
        problem = message_shape_error(self.role, True, self.content, self.tool_calls, self.tool_call_id)
        if problem is not None:
            raise PydanticCustomError("message_shape", problem)
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's: extra variables for the template (enable_thinking)
    add_generation_prompt: bool = True  # vLLM extra


class TokenizeRequest(RequestBody):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_TOKEN_IDS)


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens served from the prefix cache


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)

    @classmethod
    def of(cls, usage: Usage) -> dict[str, Any]:
        """The JSON of `usage` as OpenAI spells it (cached prompt tokens under prompt_tokens_details, as OpenAI and
        vLLM's --enable-prompt-tokens-details report them)."""
        return cls(
            prompt_tokens=usage.prompt_tokens,
            completion_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=usage.cached_tokens),
        ).model_dump()


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "batchserve"
    root: str | None = None
    max_model_len: int | None = None
    dtype: str | None = None  # what the engine computes in (dtype "auto" resolved)
    runner: str | None = None  # generate or pooling (--runner, auto resolved)
    convert: str | None = None  # a pooling runner's task: embed or classify
    parent: str | None = None  # a LoRA adapter's base model (vLLM's field)


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
