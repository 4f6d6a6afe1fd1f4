"""The disk KV tier's counters in Prometheus (docs/kv-offload.md#metrics) and in the dashboard's tier panel: read
when asked from the tier's own counts, so the step loop does nothing for them."""

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
    def __init__(self, offload: Any, writer: Any, model_name: str, block_size: int, kv: Any = None) -> None:
        self.offload, self.writer, self.model_name, self.block_size = offload, writer, model_name, block_size
        self.kv = kv  # the scheduler's KV cache manager: the requests whose prefix is being read back

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
                                      "behind: past its budget, or the pool reused the block first.", labels=["model_name"])  # fmt: skip
        skipped.add_metric([self.model_name], getattr(self.writer, "num_skipped", 0))
        yield skipped
        used = GaugeMetricFamily(
            PREFIX + "kv_tier_bytes_used", "Bytes of the disk tier's files.", labels=["model_name"]
        )
        used.add_metric([self.model_name], stats.bytes_used)
        yield used
        loading = GaugeMetricFamily(PREFIX + "kv_tier_loading_requests", "Waiting requests whose prefix the disk "
                                    "tier is reading back now.", labels=["model_name"])  # fmt: skip
        loading.add_metric([self.model_name], len(getattr(self.kv, "tier_loads", ())))
        yield loading


def register_tier_metrics(registry: CollectorRegistry, model_name: str, engine: Any) -> None:
    """The tier's metrics in `registry`, when the engine runs one."""
    offload = getattr(engine, "kv_tier", None)
    if offload is not None:
        writer = getattr(engine.runner, "offload", None)
        kv = engine.scheduler.kv
        registry.register(TierCollector(offload, writer, model_name, engine.config.cache.block_size, kv))


def tier_summary(engine: Any) -> dict[str, Any] | None:
    """The dashboard's tier panel (serving/live_stats.py): the same counts as the metrics; None without a tier."""
    offload = getattr(engine, "kv_tier", None)
    if offload is None:
        return None
    stats, block = offload.stats, engine.config.cache.block_size
    return {
        "hit_blocks": stats.hits, "hit_tokens": stats.hits * block, "blocks_read": stats.blocks_read,
        "read_bytes": stats.bytes_read, "read_s": stats.read_s, "written_blocks": stats.blocks_written,
        "written_bytes": stats.bytes_written, "write_s": stats.write_s, "corrupt_dropped": stats.corrupt_dropped,
        "write_errors": stats.write_errors, "evicted_blocks": stats.evicted, "bytes_used": stats.bytes_used,
        "max_bytes": offload.store.max_bytes, "saves_skipped": getattr(engine.runner.offload, "num_skipped", 0),
        "loading_requests": len(engine.scheduler.kv.tier_loads),
    }  # fmt: skip
