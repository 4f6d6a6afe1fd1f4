"""What the ingress and the engine replicas send each other through Ray (all picklable dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from batchserve.config import EngineConfig
from batchserve.engine.inputs import EngineLimits
from batchserve.engine.outputs import CompletionDelta
from batchserve.request import EngineRequest, LoRARequest


@dataclass(frozen=True)
class ReplicaRequest:
    """One engine request as the ingress's serving layer built it (tokenized and checked there, so the router can
    hash its blocks), and `caller`: the ingress client's id; its deltas go out on that caller's subscription."""

    request: EngineRequest
    caller: str = ""

    @property
    def request_id(self) -> str:
        return self.request.request_id

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.request.prompt_token_ids

    @property
    def lora_name(self) -> str | None:
        """The LoRA adapter the request names (None: the base model)."""
        return self.request.sampling_params.lora_name


@dataclass(frozen=True)
class EngineDescription:
    """What is fixed for an engine's life: the ingress answers /v1/models and validates prompts with it."""

    config: EngineConfig
    limits: EngineLimits
    num_kv_blocks: int
    effective_config: dict[str, Any] = field(default_factory=dict)  # every option as the replica runs it
    loras: tuple[LoRARequest, ...] = ()  # the adapters it serves (lora_modules: the same on every replica)


@dataclass(frozen=True)
class ReplicaLoadReport:
    """A replica's load, as its record_routing_stats reports it to the routers, and the LoRA adapters it holds
    loaded (read from their folders; the routers prefer a replica holding a request's adapter)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    loras: tuple[str, ...] = ()

    @property
    def queue_len(self) -> int:
        return self.num_running + self.num_waiting

    def as_dict(self) -> dict[str, Any]:
        load = {"num_running": self.num_running, "num_waiting": self.num_waiting, "kv_usage": self.kv_usage}
        return {**load, "loras": list(self.loras)}

    @classmethod
    def from_dict(cls, stats: dict[str, Any] | None) -> ReplicaLoadReport | None:
        if not stats or "num_running" not in stats:
            return None
        loras = tuple(str(name) for name in stats.get("loras", ()))
        return cls(int(stats["num_running"]), int(stats["num_waiting"]), float(stats["kv_usage"]), loras)


@dataclass(frozen=True)
class Admitted:
    """A replica's first answer to `generate`: the engine took the request."""

    replica_id: str


@dataclass(frozen=True)
class Subscribe:
    """A caller's subscription to one replica's outputs of its requests; the routers send it to that replica."""

    caller: str
    replica_id: str


@dataclass
class StepOutputs:
    """One message of a subscription: what one or more engine steps produced for the caller's requests there, and the
    requests that ended in an error instead (an engine that died, for one)."""

    outputs: list[CompletionDelta] = field(default_factory=list)
    errors: dict[str, BaseException] = field(default_factory=dict)


class WrongReplica(Exception):
    """A subscription the router delivered to another replica than the one it names: the named one is gone (the
    router routes around a dead replica), so the client treats it as that replica's loss."""
