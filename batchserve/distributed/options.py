"""RayAppOptions: everything the Ray Serve application is built from, checked by pydantic (the same object
`batchserve serve --replicas` fills from flags and `serve run batchserve.distributed.app:build key=value` or a
Serve config file's `args:` fill from strings)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from batchserve.entrypoints.openai.error_delay import (
    DEFAULT_ERROR_DELAY_AFTER,
    DEFAULT_ERROR_DELAY_CLIENTS,
    DEFAULT_ERROR_DELAY_MAX_S,
    ErrorDelayConfig,
    OffenderTable,
)

ROUTERS = ("prefix-aware", "power-of-two")


class RayAppOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    engine: dict[str, Any] = Field(default_factory=dict, description="engine options, as in a --config file")
    replicas: int = Field(2, ge=1, description="engine replicas (the minimum, when autoscaling)")
    max_replicas: int | None = Field(None, ge=1, description="autoscale between replicas and this many")
    target_ongoing_requests: float = Field(16, gt=0, description="autoscaling: engine requests per replica")
    router: Literal["prefix-aware", "power-of-two"] = "prefix-aware"
    routing: dict[str, Any] = Field(default_factory=dict, description="serving.routing.RoutingConfig fields")
    replica_num_cpus: float = Field(1.0, ge=0, description="CPUs Ray reserves per engine replica")
    max_ongoing_requests: int = Field(1024, ge=1, description="requests in flight per replica (its engine queues)")
    grpc_port: int | None = Field(None, ge=0, le=65535, description="the ingress also serves gRPC on this port")
    grpc_host: str = "127.0.0.1"
    http_port: int | None = Field(
        None, ge=0, le=65535, description="the ingress serves HTTP on this port itself (Ray's proxy is not needed)"
    )
    http_host: str = "127.0.0.1"
    served_model_name: list[str] = Field(default_factory=list)
    api_key: str | None = None
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1)
    lenient: bool = False
    stall_timeout_s: float = Field(120.0, gt=0)
    drain_timeout_s: float = Field(30.0, ge=0, description="a replica being stopped finishes its requests this long")
    health_check_period_s: float = Field(2.0, gt=0)
    # the ingress's own HTTP server: read deadlines, idle keep-alive, connection cap (serve's flags of those names)
    header_timeout_s: float = Field(30.0, gt=0)
    body_timeout_s: float = Field(60.0, gt=0)
    keep_alive_timeout_s: float = Field(5.0, gt=0)
    max_connections: int | None = Field(None, ge=1)
    # repeat offenders' 4xx answers wait, on the ingress's HTTP and gRPC alike (serve's --error-delay-* flags)
    error_delay_max_s: float = Field(DEFAULT_ERROR_DELAY_MAX_S, ge=0, description="0: no delays")
    error_delay_after: int = Field(DEFAULT_ERROR_DELAY_AFTER, ge=0)
    error_delay_clients: int = Field(DEFAULT_ERROR_DELAY_CLIENTS, ge=1)

    @model_validator(mode="after")
    def _bounds(self) -> RayAppOptions:
        if self.max_replicas is not None and self.max_replicas < self.replicas:
            raise ValueError(f"max_replicas ({self.max_replicas}) is below replicas ({self.replicas})")
        if self.engine.get("allow_runtime_lora_updating"):
            # each replica would load it on its own while the ingress lists what they had at start
            raise ValueError(
                "allow_runtime_lora_updating is not served with replicas: name the adapters in lora_modules "
                "(every replica loads them at start)"
            )
        return self

    def offender_table(self) -> OffenderTable:
        return OffenderTable(ErrorDelayConfig(self.error_delay_max_s, self.error_delay_after, self.error_delay_clients))

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None and self.max_replicas > self.replicas
