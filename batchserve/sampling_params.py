"""Per-request sampling parameters, validated once at the edge (as vLLM users know them)."""

from __future__ import annotations

import enum
import math
import time
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from batchserve.kv_retention import KVRetention

# Below this a temperature is greedy (as vLLM's _SAMPLING_EPS): dividing logits by 1e-40 overflows to inf and NaN.
GREEDY_TEMPERATURE = 1e-5
# The detokenizer checks every stop string at every token: bounded, so one request cannot slow everyone's steps.
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 512
# logit_bias is turned into index tensors at every step of the request: bounded for the same reason.
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_N = 128  # choices of one prompt
# Stop ids are checked at every token and masked at every step under min_tokens: bounded like stop strings.
MAX_STOP_TOKEN_IDS = 1024
# Above these a knob changes nothing measurable (top_k >= the vocabulary is off; such a temperature is uniform
# sampling), so a larger value is a client's mistake, refused rather than carried.
MAX_TOP_K = 1 << 20
MAX_TEMPERATURE = 100.0
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's top_logprobs bound)
LOGIT_BIAS_RANGE = 100.0  # OpenAI's: -100 bans a token, 100 all but forces it


class InvalidRequestError(ValueError):
    """A request that can never be served as asked (bad prompt or sampling values); `param` names the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type, tuple[str, str | None]]:  # pickled whole (Ray sends it between processes)
        return type(self), (str(self), self.param)


class ConstraintKind(str, enum.Enum):
    JSON = "json"  # a JSON Schema
    JSON_OBJECT = "json_object"  # any JSON object
    REGEX = "regex"
    CHOICE = "choice"  # one of a few literal strings
    GRAMMAR = "grammar"  # EBNF (GBNF-style: `root ::= ...`)


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A request's output constraint, exactly one kind: frozen and plain, so it rides unchanged from the front end
    to the worker, which compiles it and masks what it forbids. `spec`: the schema as canonical JSON text, the regex,
    the grammar, or the choices as a JSON list; a string, so equal constraints share one compiled grammar."""

    kind: ConstraintKind
    spec: str = ""
    # where the constraint came from (`response_format`, `guided_json`, `tool_choice`...): a 400 names it
    source: str = "structured_outputs"

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", ConstraintKind(self.kind))
        except ValueError:
            kinds = ", ".join(k.value for k in ConstraintKind)
            raise InvalidRequestError(
                f"a constraint's kind must be one of {kinds}, got {self.kind!r}", "structured_outputs"
            ) from None
        if not isinstance(self.spec, str):
            raise InvalidRequestError(
                f"a constraint's spec must be a string, got {type(self.spec).__name__}", "structured_outputs"
            )

    @property
    def cache_key(self) -> tuple[str, str]:
        return self.kind.value, self.spec


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: disabled
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # number of top logprobs to return per sampled token
    prompt_logprobs: int | None = None  # score every prompt token too, with this many top alternatives
    min_tokens: int = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit before sampling (OpenAI's)
    structured_outputs: StructuredOutputsParams | None = None  # a grammar the output must follow (worker masks)
    speculate: bool = True  # False: never speculate for this request (docs/speculative-decoding.md)
    # service-level targets (docs/slo.md); None: the server's --ttft-slo-ms / --tpot-slo-ms, if any
    ttft_slo_ms: float | None = None  # arrival to first token
    tpot_slo_ms: float | None = None  # mean time between output tokens after the first
    # the latest wall-clock time (Unix seconds) the request may still wait for its first token: later, it is dropped
    # instead of served late; one already past is refused at once
    deadline: float | None = None
    # how long its KV blocks should outlive it, by token range (batchserve/kv_retention.py; docs/kv-offload.md)
    kv_retention: KVRetention | None = None
    # a pooling request (batchserve/pooling_params.py): the prompt's hidden states pooled, no token sampled
    pooling: Any = None
    # the LoRA adapter the request runs with, by name (the OpenAI `model`; docs/lora.md); None: the base model
    lora_name: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = _as_list(self.stop, "stop")
        self.stop_token_ids = _as_list(self.stop_token_ids, "stop_token_ids")
        self.validate()

    @cached_property
    def sorted_stop_token_ids(self) -> tuple[int, ...]:
        """The stop ids, unique and sorted: computed once per request, not at every step that masks them."""
        return tuple(sorted(set(self.stop_token_ids)))

    @cached_property
    def sorted_stop_token_array(self) -> array:
        """The same as 64-bit integers in one buffer, which the sampler reads as a tensor without a copy."""
        return array("q", self.sorted_stop_token_ids)

    @cached_property
    def stop_token_id_set(self) -> frozenset[int]:
        """The stop ids as a set: each new token is looked up in it (once per request, not a list scan a token)."""
        return frozenset(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        """Every field's type and range; InvalidRequestError naming the first field that is wrong."""
        _integer("max_tokens", self.max_tokens, low=1)
        check_temperature(self.temperature)
        _real("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _integer("top_k", self.top_k, low=-1, high=MAX_TOP_K)
        _real("min_p", self.min_p, low=0.0, high=1.0)
        _real("repetition_penalty", self.repetition_penalty, low=0.0, low_open=True)
        _real("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _real("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        if self.seed is not None:
            _integer("seed", self.seed, low=-(2**63), high=2**64 - 1)
        _integer("n", self.n, low=1, high=MAX_N)  # the serving layer runs n > 1 as n child requests
        if self.lora_name is not None and (not isinstance(self.lora_name, str) or not self.lora_name):
            raise InvalidRequestError(f"lora_name must be an adapter's name, got {self.lora_name!r}", "lora_name")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, low=0, high=MAX_LOGPROBS)
        _integer("min_tokens", self.min_tokens, low=0, high=self.max_tokens)
        for name in ("ignore_eos", "skip_special_tokens", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(f"{name} must be true or false, got {getattr(self, name)!r}", name)
        if not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_STRING_CHARS for s in self.stop):
            raise InvalidRequestError(
                f"stop strings must be strings of 1 to {MAX_STOP_STRING_CHARS} characters", "stop"
            )
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(f"at most {MAX_STOP_STRINGS} stop strings, got {len(self.stop)}", "stop")
        if not all(s.isascii() or _is_unicode(s) for s in self.stop):
            raise InvalidRequestError("a stop string holds a lone surrogate (not valid Unicode)", "stop")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise InvalidRequestError(
                f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids, got {len(self.stop_token_ids)}", "stop_token_ids"
            )
        for token_id in self.stop_token_ids:
            _integer("stop_token_ids", token_id, low=0)
        if self.logit_bias is not None:
            _logit_bias(self.logit_bias)
        self._validate_service_targets()
        if self.kv_retention is not None:
            from batchserve.kv_retention import KVRetention  # it imports this module's error

            self.kv_retention = KVRetention.from_value(self.kv_retention)
        if self.structured_outputs is not None and not isinstance(self.structured_outputs, StructuredOutputsParams):
            raise InvalidRequestError(
                "structured_outputs must be a StructuredOutputsParams (kind and spec), got "
                f"{type(self.structured_outputs).__name__}",
                "structured_outputs",
            )

    def _validate_service_targets(self) -> None:
        for name in ("ttft_slo_ms", "tpot_slo_ms", "deadline"):
            if getattr(self, name) is not None:
                _real(name, getattr(self, name), low=0.0, low_open=True)
        if self.deadline is not None and self.deadline <= time.time():
            raise InvalidRequestError(f"deadline {self.deadline} (Unix seconds) has already passed", "deadline")


def check_temperature(value: object) -> None:
    """A temperature in [0, MAX_TEMPERATURE]; checked whatever the decoding mode, also where a front end samples
    greedily for other reasons (TensorRT-LLM's top_k = top_p = 0)."""
    _real("temperature", value, low=0.0, high=MAX_TEMPERATURE)


def _is_unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _logit_bias(bias: object) -> None:
    if not isinstance(bias, dict):
        raise InvalidRequestError(f"logit_bias must be a mapping of token id to bias, got {bias!r}", "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise InvalidRequestError(f"logit_bias may hold at most {MAX_LOGIT_BIAS_ENTRIES} tokens", "logit_bias")
    for token_id, value in bias.items():
        _integer("logit_bias", token_id, low=0)
        _real("logit_bias", value, low=-LOGIT_BIAS_RANGE, high=LOGIT_BIAS_RANGE)


def _as_list(value: object, name: str) -> list:
    if value is None:
        return []
    if isinstance(value, str | bytes) or not isinstance(value, Iterable):
        raise InvalidRequestError(f"{name} must be a list, got {type(value).__name__}", name)
    return list(value)


def _integer(name: str, value: object, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", name)
    _in_range(name, value, low, high)


def _real(
    name: str, value: object, low: float | None = None, high: float | None = None, low_open: bool = False
) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be a finite number, got {value!r}", name)
    if low_open and value <= low:
        raise InvalidRequestError(f"{name} must be > {low}, got {value}", name)
    _in_range(name, value, low, high)


def _in_range(name: str, value: float, low: float | None, high: float | None) -> None:
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f"[{low if low is not None else '-inf'}, {high if high is not None else 'inf'}]"
        raise InvalidRequestError(f"{name} must be in {bounds}, got {value}", name)
