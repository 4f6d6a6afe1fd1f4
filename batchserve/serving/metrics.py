"""Prometheus export of the engine's per-step and per-request stats, named like vLLM's (prefix ``batchserve:``).

Every metric lives in the CollectorRegistry given to (or made by) one ``EngineMetrics``: there is no global
registry, so several servers can live in one process. ``observe_step`` is called from the engine loop thread after
each step; prometheus-client's metric objects are thread safe, and ``render`` may run on any thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from batchserve.core.outputs import SchedulerStats
from batchserve.engine.async_engine import AsyncLLMEngine
from batchserve.engine.llm_engine import LLMEngine
from batchserve.engine.outputs import CompletionDelta
from batchserve.serving.kv_tier_metrics import register_tier_metrics
from batchserve.serving.lora_metrics import LoRAMetrics

PREFIX = "batchserve:"
STEP_PHASES = ("schedule", "prepare", "forward", "sample", "output")  # the fields of StepTimings, without "_s"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# Buckets as vLLM uses them (seconds / tokens).
# fmt: off
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
TPOT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0)
ITERATION_TIME_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56, 5.12)
TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
# fmt: on


class EngineMetrics:
    """The Prometheus view of one engine. Labels: ``model_name`` (as vLLM)."""

    def __init__(self, model_name: str = "", registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.model_name = model_name
        family = _Family(self.registry, model_name)
        self._add_scheduler_metrics(family)
        self._add_token_metrics(family)
        self._add_request_metrics(family)
        self._last_preemptions_total = 0
        self._last_prefix_queries = 0
        self._last_prefix_hits = 0
        self._seen_first_output: set[str] = set()

    def _add_scheduler_metrics(self, f: _Family) -> None:
        """Scheduler state (of the latest step)."""
        self.num_requests_running = f.gauge("num_requests_running", "Requests in the running batch.")
        self.num_requests_waiting = f.gauge("num_requests_waiting", "Requests waiting to be scheduled.")
        self.num_requests_swapped = f.gauge("num_requests_swapped", "Waiting requests whose KV sits in host memory.")
        self.kv_cache_usage_perc = f.gauge(
            "kv_cache_usage_perc", "KV-cache usage: share of blocks owned by requests (0-1)."
        )
        self.kv_cache_blocks_used = f.gauge("kv_cache_blocks_used", "KV blocks owned by at least one request.")
        self.kv_cache_blocks_total = f.gauge("kv_cache_blocks_total", "KV blocks in the pool.")
        self.prefix_cache_hit_rate = f.gauge("prefix_cache_hit_rate", "Prefix-cache hit rate over prompt tokens (0-1).")
        self.prefix_cache_queries = f.counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        self.prefix_cache_hits = f.counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        self.num_preemptions = f.counter("num_preemptions", "Cumulative number of preemptions.")
        self.spec_counters = {  # SchedulerStats field -> counter (speculative decoding, vLLM's names)
            "spec_num_draft_tokens": f.counter("spec_decode_num_draft_tokens", "Draft tokens proposed."),
            "spec_num_accepted_tokens": f.counter("spec_decode_num_accepted_tokens", "Draft tokens accepted."),
            "spec_num_drafts": f.counter("spec_decode_num_drafts", "Verification steps of a sequence with drafts."),
            "spec_num_emitted_tokens": f.counter(
                "spec_decode_num_emitted_tokens", "Tokens emitted by verification steps (accepted drafts + 1 each)."
            ),
        }
        self.spec_mean_acceptance_length = f.gauge(
            "spec_decode_mean_acceptance_length", "Tokens emitted per verification step, since start."
        )
        self._last_spec = dict.fromkeys(self.spec_counters, 0)
        slo = Counter(PREFIX + "slo_admission", "Requests the SLO admission acted on (docs/slo.md), by decision.",
                      ["model_name", "decision"], registry=f.registry)  # fmt: skip
        self.slo_counters = {  # SchedulerStats field -> counter
            "slo_num_refused": slo.labels(f.model_name, "refused"),
            "slo_num_demoted": slo.labels(f.model_name, "demoted"),
            "slo_num_deadline_dropped": slo.labels(f.model_name, "deadline_dropped"),
        }
        self._last_slo = dict.fromkeys(self.slo_counters, 0)

    def _add_token_metrics(self, f: _Family) -> None:
        self.prompt_tokens = f.counter("prompt_tokens", "Prompt tokens of the requests admitted.")
        self.generation_tokens = f.counter("generation_tokens", "Tokens generated.")
        self.iteration_tokens = f.histogram("iteration_tokens_total", "Tokens computed per engine step.", TOKEN_BUCKETS)
        self.iteration_time = f.histogram(
            "iteration_time_seconds", "Wall time of one engine step.", ITERATION_TIME_BUCKETS
        )
        self.step_phase_time = Counter(
            PREFIX + "step_phase_seconds",
            "Engine step wall time by phase: schedule, prepare, forward (the model and logits), sample, output.",
            ["model_name", "phase"],
            registry=f.registry,
        )
        self._step_phases = {phase: self.step_phase_time.labels(f.model_name, phase) for phase in STEP_PHASES}

    def _add_request_metrics(self, f: _Family) -> None:
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason.",
            ["model_name", "finished_reason"],
            registry=f.registry,
        )
        self.request_slo = Counter(
            PREFIX + "request_slo",
            "Finished requests with service-level targets, by whether they met them (goodput: met per second).",
            ["model_name", "result"],
            registry=f.registry,
        )
        self.time_to_first_token = f.histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.time_per_output_token = f.histogram(
            "time_per_output_token_seconds", "Mean time between output tokens of a request.", TPOT_BUCKETS
        )
        self.e2e_request_latency = f.histogram("e2e_request_latency_seconds", "Arrival to finish.", LATENCY_BUCKETS)
        self.request_queue_time = f.histogram(
            "request_queue_time_seconds", "Arrival to first scheduled.", LATENCY_BUCKETS
        )
        self.request_prompt_tokens = f.histogram("request_prompt_tokens", "Prompt tokens per request.", TOKEN_BUCKETS)
        self.request_generation_tokens = f.histogram(
            "request_generation_tokens", "Generated tokens per request.", TOKEN_BUCKETS
        )
        self.engine_config_info = Info(
            PREFIX + "engine_config", "The engine's effective configuration (as vLLM's cache_config_info).",
            ["model_name"], registry=f.registry,
        ).labels(f.model_name)  # fmt: skip
        self.mode_fallback = Gauge(
            PREFIX + "mode_fallback",
            "1 for each rule of the mode table (batchserve/modes.py) this engine runs a fallback of.",
            ["model_name", "rule"],
            registry=f.registry,
        )

    def attach(self, engine: AsyncLLMEngine) -> EngineMetrics:
        """Observe every step of `engine` from now on; what is fixed for its life (the configuration, the pool's
        size) is set now, so a scrape before the first request reads it too."""
        self.engine_config_info.info(
            {k: "" if v is None else str(v) for k, v in engine.engine.effective_config().items()}
        )
        self.kv_cache_blocks_total.set(engine.engine.runner.num_kv_blocks)
        for rule in engine.engine.modes.fallback_names:
            self.mode_fallback.labels(self.model_name, rule).set(1)
        register_tier_metrics(self.registry, self.model_name, engine.engine)
        engine.step_listeners.append(self._on_step)
        if engine.engine.config.enable_lora:
            lora = LoRAMetrics(self.registry, self.model_name, engine.engine.config.max_loras)
            engine.step_listeners.append(lora.on_step)
        return self

    # ------------------------------------------------------------------ engine loop thread
    def _on_step(self, engine: LLMEngine, outputs: list[CompletionDelta]) -> None:
        self.observe_step(engine.last_stats, engine.last_step_time_s, outputs)
        for phase, counter in self._step_phases.items():
            counter.inc(getattr(engine.last_timings, f"{phase}_s"))

    def observe_stats(self, stats: SchedulerStats | None) -> None:
        """Gauges and cumulative counters from a SchedulerStats snapshot."""
        if stats is None:
            return
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.num_requests_swapped.set(stats.num_swapped)
        self.kv_cache_usage_perc.set(stats.kv_usage)
        self.kv_cache_blocks_used.set(stats.kv_blocks_used)
        self.kv_cache_blocks_total.set(stats.kv_blocks_total)
        self.prefix_cache_hit_rate.set(stats.prefix_cache_hit_rate)
        self._last_preemptions_total = _advance(
            self.num_preemptions, stats.num_preemptions_total, self._last_preemptions_total
        )
        self._last_prefix_queries = _advance(
            self.prefix_cache_queries, stats.prefix_cache_queries, self._last_prefix_queries
        )
        self._last_prefix_hits = _advance(self.prefix_cache_hits, stats.prefix_cache_hits, self._last_prefix_hits)
        for name, counter in self.spec_counters.items():
            self._last_spec[name] = _advance(counter, getattr(stats, name), self._last_spec[name])
        for name, counter in self.slo_counters.items():
            self._last_slo[name] = _advance(counter, getattr(stats, name), self._last_slo[name])
        if stats.spec_num_drafts:
            self.spec_mean_acceptance_length.set(stats.spec_num_emitted_tokens / stats.spec_num_drafts)

    def observe_step(
        self, stats: SchedulerStats | None, step_time_s: float | None, outputs: Iterable[CompletionDelta]
    ) -> None:
        """After one engine step: its stats, its wall time, and the CompletionDeltas it produced."""
        self.observe_stats(stats)
        if stats is not None:
            self.iteration_tokens.observe(stats.num_prefill_tokens + stats.num_decode_tokens)
        if step_time_s is not None:
            self.iteration_time.observe(step_time_s)
        for out in outputs:
            self.observe_output(out)

    def observe_output(self, out: CompletionDelta) -> None:
        if out.delta_token_ids:
            self.generation_tokens.inc(len(out.delta_token_ids))
        if out.request_id not in self._seen_first_output:
            self._seen_first_output.add(out.request_id)
            self.prompt_tokens.inc(out.num_prompt_tokens)
        if out.finished:
            self._seen_first_output.discard(out.request_id)
            self.observe_finished(out)

    def observe_finished(self, out: CompletionDelta) -> None:
        self.request_success.labels(self.model_name, str(out.finish_reason or "abort")).inc()
        self.request_prompt_tokens.observe(out.num_prompt_tokens)
        self.request_generation_tokens.observe(out.num_output_tokens)
        m = out.metrics
        met = m.slo_met(out.num_output_tokens)
        if met is not None:
            self.request_slo.labels(self.model_name, "met" if met else "missed").inc()
        if m.first_scheduled_time is not None:
            self.request_queue_time.observe(max(0.0, m.first_scheduled_time - m.arrival_time))
        if m.first_token_time is not None:
            self.time_to_first_token.observe(max(0.0, m.first_token_time - m.arrival_time))
            if m.finished_time is not None and out.num_output_tokens > 1:
                self.time_per_output_token.observe(
                    max(0.0, m.finished_time - m.first_token_time) / (out.num_output_tokens - 1)
                )
        if m.finished_time is not None:
            self.e2e_request_latency.observe(max(0.0, m.finished_time - m.arrival_time))

    # ------------------------------------------------------------------ any thread
    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))


class _Family:
    """Metrics of one registry, each labelled with the one model name."""

    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.registry = registry
        self.model_name = model_name

    def gauge(self, name: str, doc: str) -> Any:
        return Gauge(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def counter(self, name: str, doc: str) -> Any:
        return Counter(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(self.model_name)

    def histogram(self, name: str, doc: str, buckets: Iterable[float]) -> Any:
        metric = Histogram(PREFIX + name, doc, ["model_name"], buckets=tuple(buckets), registry=self.registry)
        return metric.labels(self.model_name)


class _WithoutCreated:
    """The registry without the `_created` series prometheus-client adds to every counter and histogram (vLLM
    drops them too): a second series per metric, holding a timestamp, that dashboards mistake for a value.
    Filtered here rather than by the client's process-wide switch, so one server's choice is not every registry's."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Any]:
        for metric in self.registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


def _advance(counter: Any, total: int, last: int) -> int:
    """Feed a cumulative total into a Prometheus counter; returns the new 'last seen' total."""
    if total > last:
        counter.inc(total - last)
    return max(total, last)


def parse_metrics(text: str) -> dict[str, float]:
    """A small reader for tests and tools: ``{'batchserve:num_requests_running': 3.0, ...}`` (labels dropped; for
    labelled series that repeat, the values are summed)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0]
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue
    return values
