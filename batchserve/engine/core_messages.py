"""What the API server process and the engine core process say to each other over their channel
(batchserve/host/channel.py). The API process sends AddRequests, AbortRequests and Shutdown; the engine core answers
with CoreReady (or CoreFailed) once, then Admissions and StepDone as it goes, and Stopped last."""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from transformers import PreTrainedTokenizerBase

from batchserve.config import EngineConfig
from batchserve.core.outputs import SchedulerStats
from batchserve.engine.inputs import EngineLimits
from batchserve.engine.outputs import CompletionDelta
from batchserve.request import EngineRequest


# ---------------------------------------------------------------------- API process -> engine core
@dataclass
class AddRequests:
    """Requests to admit, each with the sequence number its Admission answers to (an id may be taken)."""

    requests: list[tuple[int, EngineRequest]]


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    """drain: finish what is in flight and refuse new requests; otherwise abort everything now. Either way the core
    answers Stopped and exits."""

    drain: bool


# ---------------------------------------------------------------------- engine core -> API process
@dataclass
class EngineDescription:
    """What is fixed for the engine's life: the API process serves from it without asking again."""

    config: EngineConfig  # as the engine runs it (dtype and tokenizer resolved)
    limits: EngineLimits
    tokenizer: PreTrainedTokenizerBase
    effective_config: dict[str, Any]
    num_kv_blocks: int
    fallback_names: list[str]
    pid: int


class DescribedEngine:
    """The read-only face of an engine that is served from its description (the engine core process's, a Ray
    replica's): what the API process asks for at every request, without a round trip."""

    description: Any

    @property
    def config(self) -> EngineConfig:
        return self.description.config

    @property
    def limits(self) -> EngineLimits:
        return self.description.limits


@dataclass
class CoreReady:
    description: EngineDescription


@dataclass
class CoreFailed:
    """The engine could not be built (a bad model path, not enough memory): the error, for the operator."""

    error: BaseException


@dataclass
class Admissions:
    """For each sequence number of an AddRequests: None (admitted) or the error the engine raised."""

    results: list[tuple[int, BaseException | None]]


@dataclass
class StepDone:
    """One engine step: its outputs and the engine's state after it (metrics, the dashboard and traces read it)."""

    outputs: list[CompletionDelta]
    stats: SchedulerStats | None
    step_time_s: float
    timings: Any  # llm_engine.StepTimings
    num_steps: int
    progressed: bool
    preemptions: dict[str, int] = field(default_factory=dict)  # request id -> its preemptions, after a preemption
    aborted: list[str] = field(default_factory=list)  # aborted by the core since the last step: their streams end


@dataclass
class Stopped:
    num_aborted: int


def portable_error(exc: BaseException) -> BaseException:
    """The exception itself if it survives pickling, else a RuntimeError naming it (a channel message must arrive)."""
    try:
        pickle.loads(pickle.dumps(exc))
    except Exception:  # noqa: BLE001 - any failure to round-trip means: send a plain one
        return RuntimeError(f"{type(exc).__name__}: {exc}")
    return exc
