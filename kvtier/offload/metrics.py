"""Offloading metrics, kept as plain counters and mirrored into the engine's registry.

The plain counters make `snapshot()` work with no registry (unit tests, connector stats); the
registry (kvtier.engine.metrics.MetricsRegistry) puts the same numbers on /metrics.
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

from kvtier.offload.busy_time import BusyTime

# Latency buckets for a chunk move: sub-millisecond memcpy up to a slow network disk.
_LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


class OffloadMetrics:
    def __init__(self, registry: Any = None) -> None:
        self.values: dict[str, float] = defaultdict(float)
        self._busy_time: dict[str, BusyTime] = defaultdict(BusyTime)
        self._registry = registry
        # Labelled series by (collector, label values): prometheus_client's `labels()` costs
        # ~10 us a call, and a lookup of an 8k-token prompt makes ~2,000 of them.
        self._series: dict[tuple[Any, ...], Any] = {}
        if registry is None:
            return
        self._fill = registry.gauge("kvtier:offload_host_fill_ratio",
                                    "Share of host-tier chunk slots in use")
        self._bytes = registry.counter("kvtier:offload_bytes",
                                       "Bytes moved between tiers", ["direction"])
        self._throughput = registry.gauge(
            "kvtier:offload_throughput_bytes_per_second",
            "Bytes moved per second of busy time (kvtier:offload_busy_seconds)", ["direction"])
        self._busy = registry.counter(
            "kvtier:offload_busy_seconds",
            "Wall-clock seconds with at least one transfer running (overlapping transfers "
            "count once; divide bytes by this, not by the transfer_seconds sum)", ["direction"])
        self._transfer = registry.histogram(
            "kvtier:offload_transfer_seconds",
            "Duration of one transfer (a worker copy batch or one tier job); transfers "
            "overlap, so the sum is not busy time", ["direction"], _LATENCY_BUCKETS)
        self._lookup = registry.histogram("kvtier:offload_tier_lookup_seconds",
                                          "Time of one tier lookup", ["tier"], _LATENCY_BUCKETS)
        self._hits = registry.counter("kvtier:offload_tier_hits", "Chunk lookups that hit",
                                      ["tier"])
        self._queries = registry.counter("kvtier:offload_tier_queries", "Chunk lookups",
                                         ["tier"])
        self._dirty = registry.gauge(
            "kvtier:offload_host_dirty_chunks",
            "Host-tier chunks not yet written to the secondary tiers (write_policy=write_back)")
        self._dropped = registry.counter(
            "kvtier:offload_writeback_dropped",
            "Dirty chunks evicted from the host tier before their write-back (write_back: the "
            "writes fall behind the stores)")
        self._dropped_stores = registry.counter(
            "kvtier:offload_tier_dropped_stores",
            "Chunks not stored on a secondary tier (reason backpressure: the tier had "
            "max_pending_stores stores in flight; read_only: the tier's directory is "
            "read-only)", ["tier", "reason"])
        self._skipped_stores = registry.counter(
            "kvtier:offload_skipped_stores",
            "Chunks not copied from the device to host memory (reason no_host_slot: every host "
            "slot was busy with a transfer)", ["reason"])
        self._errors = registry.counter("kvtier:offload_tier_errors",
                                        "Failed tier operations (I/O errors, corrupt data, "
                                        "deadlines, exceptions)", ["tier"])

    def set_fill_ratio(self, ratio: float) -> None:
        self.values["kvtier:offload_host_fill_ratio"] = ratio
        if self._registry is not None:
            self._fill.set(ratio)

    def set_dirty(self, num_dirty: int, num_dropped_total: int) -> None:
        dropped = num_dropped_total - self.values["kvtier:offload_writeback_dropped_total"]
        self.values["kvtier:offload_host_dirty_chunks"] = num_dirty
        self.values["kvtier:offload_writeback_dropped_total"] = num_dropped_total
        if self._registry is not None:
            self._dirty.set(num_dirty)
            if dropped:
                self._dropped.inc(dropped)

    def lookup(self, tier: str, hit: bool, seconds: float) -> None:
        self._inc("kvtier:offload_tier_queries", tier, 1)
        if hit:
            self._inc("kvtier:offload_tier_hits", tier, 1)
        if self._registry is not None:
            self._series_of(self._queries, tier).inc()
            if hit:
                self._series_of(self._hits, tier).inc()
            self._series_of(self._lookup, tier).observe(seconds)

    def error(self, tier: str) -> None:
        self._inc("kvtier:offload_tier_errors", tier, 1)
        if self._registry is not None:
            self._series_of(self._errors, tier).inc()

    def dropped_store(self, tier: str, reason: str) -> None:
        self.values[f'kvtier:offload_tier_dropped_stores_total{{tier="{tier}",'
                    f'reason="{reason}"}}'] += 1
        if self._registry is not None:
            self._series_of(self._dropped_stores, tier, reason).inc()

    def skipped_store(self, reason: str) -> None:
        self.values[f'kvtier:offload_skipped_stores_total{{reason="{reason}"}}'] += 1
        if self._registry is not None:
            self._series_of(self._skipped_stores, reason).inc()

    def transfer(self, direction: str, num_bytes: int, seconds: float,
                 ended: float | None = None) -> None:
        """A transfer moved `num_bytes` in `direction` (e.g. "device_to_host", "fs_to_host") in
        `seconds` that ended at `ended` (time.monotonic(); default: now)."""
        ended = time.monotonic() if ended is None else ended
        busy = self._busy_time[direction]
        added = busy.add(ended - seconds, ended)
        self.values[f'kvtier:offload_bytes_total{{direction="{direction}"}}'] += num_bytes
        self.values[f'kvtier:offload_busy_seconds_total{{direction="{direction}"}}'] = busy.seconds
        if self._registry is None:
            return
        self._series_of(self._bytes, direction).inc(num_bytes)
        self._series_of(self._busy, direction).inc(added)
        self._series_of(self._transfer, direction).observe(seconds)
        if busy.seconds > 0:
            total = self.values[f'kvtier:offload_bytes_total{{direction="{direction}"}}']
            self._series_of(self._throughput, direction).set(total / busy.seconds)

    def snapshot(self) -> dict[str, float]:
        return dict(self.values)

    def _series_of(self, collector: Any, *label_values: str) -> Any:
        """`collector.labels(*label_values)`, made once."""
        series = self._series.get((collector, *label_values))
        if series is None:
            series = self._series[(collector, *label_values)] = collector.labels(*label_values)
        return series

    def _inc(self, name: str, tier: str, amount: float) -> None:
        self.values[f'{name}_total{{tier="{tier}"}}'] += amount
