"""A request twice: as a front end hands it to an engine (EngineRequest, built and checked once, then passed
unchanged down to the engine), and as the scheduler tracks it (Request: plain Python, derived counts as properties)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from batchserve.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # back in the waiting queue, KV dropped (recompute)
    SWAPPED = "swapped"  # back in the waiting queue, KV parked in host memory
    LOADING = "loading"  # waiting, holding blocks the disk tier is reading its prefix back into
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # EOS, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # client went away or the engine was asked to drop it


@dataclass(frozen=True)
class LoRARequest:
    """A LoRA adapter a request runs with (vLLM's shape): `lora_name` is what requests call it (the OpenAI `model`),
    `lora_int_id` (> 0) its identity (prefix-cache keys, slots), `lora_path` a PEFT folder."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if not isinstance(self.lora_int_id, int) or self.lora_int_id <= 0:
            raise ValueError(f"lora_int_id must be a positive integer, got {self.lora_int_id!r}")
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty name")


@dataclass(frozen=True)
class EngineRequest:
    """One request on its way down: built once, by engine/inputs.RequestBuilder (the one place its prompt and
    sampling values are checked), then handed unchanged through EngineClient, the async engine, a Ray replica and
    LLMEngine.add_request. `prompt`: the text the ids came from, when the caller gave text (an echo needs it)."""

    request_id: str
    prompt_token_ids: list[int]  # within the engine's limits (truncated, if the engine truncates)
    sampling_params: SamplingParams  # validated
    priority: int = 0  # lower is served first under scheduling_order="priority"
    arrival_time: float = field(default_factory=time.monotonic)
    prompt: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()  # ignored when sampling_params.ignore_eos
    priority: int = 0  # lower is served first under scheduling_order="priority"
    arrival_time: float = field(default_factory=time.monotonic)

    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0  # tokens whose K/V are in the cache
    num_cached_prompt_tokens: int = 0  # prompt tokens served by a prefix-cache hit, at first admission
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # the first block's parent in its prefix-cache keys: sequences with another salt never share blocks
    # (core/long_context.py: LongRoPE's long sequences)
    cache_salt: int | None = None
    # service-level targets in seconds, the request's own or the server's (Scheduler.add_request fills them), and
    # the queue deadline on the scheduler's clock: past it, a request that has not started is dropped (core/slo.py)
    ttft_slo_s: float | None = None
    tpot_slo_s: float | None = None
    deadline: float | None = None
    slo_demoted: bool = False  # predicted to miss its TTFT target: served after those that can still meet theirs
    lora_id: int = 0  # its adapter's lora_int_id; 0: the base model (core/lora_schedule.py)
    # timings (time.monotonic)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    @classmethod
    def of(cls, request: EngineRequest, eos_token_ids: tuple[int, ...]) -> Request:
        scheduled = cls(
            request.request_id,
            request.prompt_token_ids,
            request.sampling_params,
            eos_token_ids,
            request.priority,
            request.arrival_time,
        )
        wall_deadline = request.sampling_params.deadline
        if wall_deadline is not None:  # Unix seconds -> the monotonic clock its arrival time is on
            scheduled.deadline = request.arrival_time + (wall_deadline - time.time())
        return scheduled

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)  # the scheduler's hottest read: no inner calls

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def max_total_tokens(self) -> int:
        """Worst-case length: prompt plus every token it may still generate."""
        return self.num_prompt_tokens + self.sampling_params.max_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
