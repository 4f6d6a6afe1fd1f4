"""The disk KV tier's counters in Prometheus (docs/kv-offload.md#metrics): read at scrape time from the tier's own
counts, so the step loop does nothing for them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "batchserve:"

# (metric, TierStats field or a function of the stats, help)
COUNTERS = (
    ("kv_tier_hit_blocks", "hits", "Blocks read back from the disk tier instead of recomputed."),
    ("kv_tier_read_bytes", "bytes_read", "Bytes read from the disk tier (checked)."),
    ("kv_tier_read_seconds", "read_s", "Seconds spent reading and checking disk-tier blocks."),
    ("kv_tier_written_blocks", "blocks_written", "Blocks written to the disk tier."),
    ("kv_tier_written_bytes", "bytes_written", "Bytes written to the disk tier."),
    ("kv_tier_write_seconds", "write_s", "Seconds the tier's writer spent writing blocks (off the step path)."),
    ("kv_tier_corrupt_dropped", "corrupt_dropped", "Disk-tier files that failed a check: deleted, recomputed."),
    ("kv_tier_write_errors", "write_errors", "Disk-tier writes that failed (a full disk): served from the pool only."),
    ("kv_tier_evicted_blocks", "evicted", "Disk-tier files deleted to stay within kv_offload_max_bytes."),
)


class TierCollector:
    def __init__(self, offload: Any, writer: Any, model_name: str, block_size: int) -> None:
        self.offload, self.writer, self.model_name, self.block_size = offload, writer, model_name, block_size

    def collect(self) -> Iterable[Any]:
        stats = self.offload.stats
        for name, field, doc in COUNTERS:
            metric = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            metric.add_metric([self.model_name], getattr(stats, field))
            yield metric
        hit_tokens = CounterMetricFamily(PREFIX + "kv_tier_hit_tokens", "Prompt tokens served by the disk tier "
                                         "(beside prefix_cache_hits, the pool's).", labels=["model_name"])  # fmt: skip
        hit_tokens.add_metric([self.model_name], stats.hits * self.block_size)
        yield hit_tokens
        skipped = CounterMetricFamily(PREFIX + "kv_tier_saves_skipped", "Blocks not written because the writer was "
                                      "behind by more than its queue.", labels=["model_name"])  # fmt: skip
        skipped.add_metric([self.model_name], getattr(self.writer, "num_skipped", 0))
        yield skipped
        used = GaugeMetricFamily(PREFIX + "kv_tier_bytes_used", "Bytes of the disk tier's files.", labels=["model_name"])
        used.add_metric([self.model_name], stats.bytes_used)
        yield used


def register_tier_metrics(registry: CollectorRegistry, model_name: str, engine: Any) -> None:
    """The tier's metrics in `registry`, when the engine runs one."""
    offload = getattr(engine, "kv_tier", None)
    if offload is not None:
        writer = getattr(engine.runner, "offload", None)
        registry.register(TierCollector(offload, writer, model_name, engine.config.cache.block_size))
