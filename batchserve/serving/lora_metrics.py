"""Per-adapter metrics of an engine serving LoRA adapters: vLLM's `lora_requests_info` gauge (labels
`running_lora_adapters`, `waiting_lora_adapters`, `max_lora`; its value the time of the latest update), and the
running and waiting requests of each adapter (`lora_requests_running` / `lora_requests_waiting{lora_name}`).
Updated from the engine loop thread after each step."""

from __future__ import annotations

import time
from collections import Counter

from prometheus_client import CollectorRegistry, Gauge

from batchserve.engine.llm_engine import LLMEngine

PREFIX = "batchserve:"


class LoRAMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str, max_loras: int) -> None:
        self.model_name, self.max_loras = model_name, max_loras
        self.info = Gauge(
            PREFIX + "lora_requests_info",
            "Adapters of the running and waiting requests (vLLM's shape); the value is the update's time.",
            ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=registry,
        )
        by_adapter = ["model_name", "lora_name"]
        self.running = Gauge(PREFIX + "lora_requests_running", "Running requests of each adapter.", by_adapter,
                             registry=registry)  # fmt: skip
        self.waiting = Gauge(PREFIX + "lora_requests_waiting", "Waiting requests of each adapter.", by_adapter,
                             registry=registry)  # fmt: skip
        self._info_labels: tuple[str, ...] | None = None

    def on_step(self, engine: LLMEngine, _outputs: object = None) -> None:
        registry = engine.loras
        if registry is None:
            return
        names = {lora.lora_int_id: lora.lora_name for lora in registry.served}
        running = Counter(names.get(r.lora_id, "") for r in engine.scheduler.running if r.lora_id)
        waiting = Counter(names.get(r.lora_id, "") for r in engine.scheduler.waiting if r.lora_id)
        for name in names.values():
            self.running.labels(self.model_name, name).set(running.get(name, 0))
            self.waiting.labels(self.model_name, name).set(waiting.get(name, 0))
        labels = (self.model_name, str(self.max_loras), ",".join(sorted(running)), ",".join(sorted(waiting)))
        if labels != self._info_labels:  # one series at a time: the previous combination goes
            if self._info_labels is not None:
                self.info.remove(*self._info_labels)
            self._info_labels = labels
        self.info.labels(*labels).set(time.time())
