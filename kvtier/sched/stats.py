"""A snapshot of the scheduler for the engine's metrics."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SchedulerStats:
    """Gauges are current values; counters (`prefix_cache_*`, `num_preemptions`,
    `num_kv_load_*`, `num_connector_lookup_timeouts`, `connector_stats`) are increments since
    the previous `make_stats()`."""

    num_running: int
    # Includes requests waiting for their KV to arrive from a connector.
    num_waiting: int
    num_waiting_for_remote_kvs: int
    # Fraction of usable device blocks in use, in [0, 1].
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_kv_load_failures: int
    num_kv_load_timeouts: int
    # Requests admitted without the connector after it kept answering "not yet" too long.
    num_connector_lookup_timeouts: int = 0
    # Worker connector stats (KVConnectorOutput.stats), summed over the steps since last time.
    connector_stats: dict[str, float] = field(default_factory=dict)
