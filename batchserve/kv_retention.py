"""A request's KV retention: how long its blocks should outlive it in the pool and the disk tier.

The shape is TensorRT-LLM's KvCacheRetentionConfig: token ranges, each with a priority from 1 to 100 (higher stays
longer) and an optional duration after which the blocks count as the default priority again; tokens past every range
and the generated ones take the decode priority. A system prompt at 90 for an hour is
`KVRetention([TokenRangeRetention(0, 512, 90, 3600)])`. Eviction, from the pool and from the tier, goes by priority,
then by what waiting requests will need, then least recently used (docs/kv-offload.md#retention).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from batchserve.sampling_params import InvalidRequestError

DEFAULT_PRIORITY = 35  # TensorRT-LLM's: what a block of a request without a retention config gets
FIELD = "kv_retention"


@dataclass(frozen=True)
class TokenRangeRetention:
    token_start: int
    token_end: int | None  # exclusive; None: to the end of the prompt
    priority: int
    duration_s: float | None = None  # None: for as long as the block lives


@dataclass(frozen=True)
class KVRetention:
    token_ranges: tuple[TokenRangeRetention, ...] = ()
    decode_priority: int = DEFAULT_PRIORITY
    decode_duration_s: float | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "token_ranges", tuple(self.token_ranges))
        for i, r in enumerate(self.token_ranges):
            where = f"{FIELD}.token_ranges[{i}]"
            _integer(f"{where}.token_start", r.token_start, 0)
            if r.token_end is not None:
                _integer(f"{where}.token_end", r.token_end, r.token_start + 1)
            _priority(f"{where}.priority", r.priority)
            _duration(f"{where}.duration_s", r.duration_s)
        _priority(f"{FIELD}.decode_priority", self.decode_priority)
        _duration(f"{FIELD}.decode_duration_s", self.decode_duration_s)

    def block_retention(self, start: int, num_prompt_tokens: int) -> tuple[int, float | None]:
        """(priority, duration) of the block whose first token is at `start`: the highest-priority range that holds
        that token; a block of generated tokens, or one no range holds, takes the decode priority."""
        best: TokenRangeRetention | None = None
        for r in self.token_ranges:
            end = r.token_end if r.token_end is not None else num_prompt_tokens
            if r.token_start <= start < end and (best is None or r.priority > best.priority):
                best = r
        if best is None:
            return self.decode_priority, self.decode_duration_s
        return best.priority, best.duration_s

    @classmethod
    def from_value(cls, value: Any) -> KVRetention | None:
        """From a front end's JSON object (TensorRT-LLM's field names are taken too: token_range_retention_configs,
        duration_ms, decode_retention_priority); InvalidRequestError naming the field that is wrong."""
        if value is None or isinstance(value, KVRetention):
            return value
        if not isinstance(value, dict):
            raise InvalidRequestError(f"{FIELD} must be an object, got {type(value).__name__}", FIELD)
        ranges = value.get("token_ranges", value.get("token_range_retention_configs", [])) or []
        if not isinstance(ranges, list):
            raise InvalidRequestError(f"{FIELD}.token_ranges must be a list", f"{FIELD}.token_ranges")
        parsed = []
        for i, r in enumerate(ranges):
            if not isinstance(r, dict):
                raise InvalidRequestError(f"{FIELD}.token_ranges[{i}] must be an object", f"{FIELD}.token_ranges")
            parsed.append(
                TokenRangeRetention(
                    r.get("token_start", 0), r.get("token_end"), r.get("priority", DEFAULT_PRIORITY), _seconds(r)
                )
            )
        decode = value.get("decode_priority", value.get("decode_retention_priority", DEFAULT_PRIORITY))
        decode_s = value.get("decode_duration_s")
        if decode_s is None and value.get("decode_duration_ms") is not None:
            decode_s = _real_ms(value["decode_duration_ms"], f"{FIELD}.decode_duration_ms")
        return cls(tuple(parsed), decode, decode_s)


def _seconds(r: dict) -> float | None:
    if r.get("duration_s") is not None:
        return r["duration_s"]
    if r.get("duration_ms") is not None:
        return _real_ms(r["duration_ms"], f"{FIELD}.token_ranges.duration_ms")
    return None


def _real_ms(value: Any, name: str) -> float:
    _duration(name, value)
    return value / 1000.0


def _integer(name: str, value: Any, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequestError(f"{name} must be an integer, got {value!r}", name)
    if value < low:
        raise InvalidRequestError(f"{name} must be >= {low}, got {value}", name)


def _priority(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise InvalidRequestError(f"{name} must be an integer from 1 to 100, got {value!r}", name)


def _duration(name: str, value: Any) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        raise InvalidRequestError(f"{name} must be a positive number of seconds, got {value!r}", name)
