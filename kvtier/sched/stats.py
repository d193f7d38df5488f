"""A snapshot of the scheduler for the engine's metrics."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.kv import Request
    from kvtier.sched.scheduler import Scheduler


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
    # Speculative decoding: drafts made, their tokens, and the tokens of them kept.
    num_spec_drafts: int = 0
    num_spec_draft_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    # With LoRA on: the adapters of running and of waiting requests, by name (sorted).
    running_loras: tuple[str, ...] | None = None
    waiting_loras: tuple[str, ...] | None = None


def take_stats(scheduler: Scheduler) -> SchedulerStats:
    """The scheduler's gauges now and its counters since the last call, which restart."""
    prefix = scheduler.kv_cache_manager.make_prefix_cache_stats()
    drafts = (0, 0, 0) if scheduler.drafts is None else scheduler.drafts.take_counts()
    stats = SchedulerStats(
        num_running=len(scheduler.running),
        num_waiting=len(scheduler.waiting),
        num_waiting_for_remote_kvs=scheduler.loads.num_in_flight,
        kv_cache_usage=scheduler.kv_cache_manager.usage,
        prefix_cache_queries=prefix.queries,
        prefix_cache_hits=prefix.hits,
        num_preemptions=scheduler.num_preemptions,
        num_kv_load_failures=scheduler.failures.num_load_failures,
        num_kv_load_timeouts=scheduler.failures.num_load_timeouts,
        num_connector_lookup_timeouts=scheduler.lookups.num_timeouts,
        connector_stats=scheduler.connector_stats, num_spec_drafts=drafts[0],
        num_spec_draft_tokens=drafts[1], num_spec_accepted_tokens=drafts[2],
        **_lora_names(scheduler))
    scheduler.num_preemptions = 0
    scheduler.lookups.num_timeouts = 0
    scheduler.failures.reset_counts()
    scheduler.connector_stats = {}
    return stats


def _lora_names(scheduler: Scheduler) -> dict[str, tuple[str, ...]]:
    if scheduler.config.max_loras is None:
        return {}
    return {"running_loras": _names(scheduler.running), "waiting_loras": _names(scheduler.waiting)}


def _names(requests: Iterable[Request]) -> tuple[str, ...]:
    return tuple(sorted({r.lora_name for r in requests if r.lora_name is not None}))
