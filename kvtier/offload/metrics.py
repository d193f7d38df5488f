"""Offloading metrics, kept as plain counters and mirrored into the engine's registry.

The plain counters make `snapshot()` work with no registry (unit tests, connector stats); the
registry (kvtier.engine.metrics.MetricsRegistry) puts the same numbers on /metrics. Lookups and
transfers, counted per chunk (an 8k-token prompt's lookup is ~1,000 of them, a disk hit's
promotions ~500 transfers), are gathered and applied at `flush()`, which the tiering manager
calls once per engine step: applied one by one they took ~11 ms of the engine thread for such a
disk hit, while the tier's read threads waited on it for the GIL.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from kvtier.offload.busy_time import BusyTime

# Latency buckets for a chunk move: sub-millisecond memcpy up to a slow network disk.
_LATENCY_BUCKETS = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 30.0)


@dataclass
class _PendingTransfers:
    num_bytes: int = 0
    # (start, end) of each transfer, in time.monotonic() seconds
    intervals: list[tuple[float, float]] = field(default_factory=list)


class OffloadMetrics:
    def __init__(self, registry: Any = None) -> None:
        self.values: dict[str, float] = defaultdict(float)
        self._busy_time: dict[str, BusyTime] = defaultdict(BusyTime)
        self._registry = registry
        # Labelled series by (collector, label values): prometheus_client's `labels()` costs
        # ~10 us a call, and a lookup of an 8k-token prompt makes ~2,000 of them.
        self._series: dict[tuple[Any, ...], Any] = {}
        # Not yet flushed: lookups by (tier, hit); lookup seconds by tier; per transfer
        # direction its bytes, busy seconds added and each transfer's seconds.
        self._lookups: dict[tuple[str, bool], int] = defaultdict(int)
        self._lookup_seconds: dict[str, list[float]] = defaultdict(list)
        self._transfers: dict[str, _PendingTransfers] = defaultdict(_PendingTransfers)
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

    def lookup(self, tier: str, hit: bool, seconds: float | None = None, count: int = 1) -> None:
        """`count` lookups of `tier` that hit or missed; `seconds`, the time of one, goes to
        the latency histogram (None: not timed, e.g. host memory's dictionary probe)."""
        self._lookups[tier, hit] += count
        if self._registry is not None and seconds is not None:
            self._lookup_seconds[tier].append(seconds)

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
        pending = self._transfers[direction]
        pending.num_bytes += num_bytes
        pending.intervals.append((ended - seconds, ended))

    def flush(self) -> None:
        """Apply the lookups and transfers counted since the last flush."""
        lookups, self._lookups = self._lookups, defaultdict(int)
        for (tier, hit), count in lookups.items():
            self._inc("kvtier:offload_tier_queries", tier, count)
            if hit:
                self._inc("kvtier:offload_tier_hits", tier, count)
            if self._registry is not None:
                self._series_of(self._queries, tier).inc(count)
                if hit:
                    self._series_of(self._hits, tier).inc(count)
        lookup_seconds, self._lookup_seconds = self._lookup_seconds, defaultdict(list)
        for tier, values in lookup_seconds.items():
            histogram = self._series_of(self._lookup, tier)
            for seconds in values:
                histogram.observe(seconds)
        transfers, self._transfers = self._transfers, defaultdict(_PendingTransfers)
        for direction, pending in transfers.items():
            self._flush_transfers(direction, pending)

    def _flush_transfers(self, direction: str, pending: _PendingTransfers) -> None:
        busy_added = self._busy_time[direction].add_all(pending.intervals)
        busy = self._busy_time[direction].seconds
        total_key = f'kvtier:offload_bytes_total{{direction="{direction}"}}'
        self.values[total_key] += pending.num_bytes
        self.values[f'kvtier:offload_busy_seconds_total{{direction="{direction}"}}'] = busy
        if self._registry is None:
            return
        self._series_of(self._bytes, direction).inc(pending.num_bytes)
        self._series_of(self._busy, direction).inc(busy_added)
        histogram = self._series_of(self._transfer, direction)
        for start, end in pending.intervals:
            histogram.observe(end - start)
        if busy > 0:
            self._series_of(self._throughput, direction).set(self.values[total_key] / busy)

    def snapshot(self) -> dict[str, float]:
        self.flush()
        return dict(self.values)

    def _series_of(self, collector: Any, *label_values: str) -> Any:
        """`collector.labels(*label_values)`, made once."""
        series = self._series.get((collector, *label_values))
        if series is None:
            series = self._series[(collector, *label_values)] = collector.labels(*label_values)
        return series

    def _inc(self, name: str, tier: str, amount: float) -> None:
        self.values[f'{name}_total{{tier="{tier}"}}'] += amount

