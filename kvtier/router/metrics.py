"""The router's own Prometheus series (GET /metrics)."""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class RouterMetrics:
    def __init__(self, index_size: Callable[[], int], index_evictions: Callable[[], int]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.decisions = Counter("kvtier_router:decisions", "Routing decisions by policy and "
                                 "reason.", ["policy", "reason"], registry=r)
        self.retries = Counter("kvtier_router:retries", "Requests tried again on another "
                               "instance, by what failed before any byte reached the client.",
                               ["reason"], registry=r)
        self.requests = Counter("kvtier_router:requests", "Requests answered, by outcome.",
                                ["outcome"], registry=r)
        self.prefills = Counter("kvtier_router:prefills", "P/D mode: prompts sent to a prefill "
                                "instance, by outcome (anything but ok: the decode instance "
                                "computes the prompt itself).", ["outcome"], registry=r)
        self.prompt_tokens = Counter("kvtier_router:prompt_tokens", "Prompt tokens of requests "
                                     "whose usage reported cached tokens.", registry=r)
        self.predicted_cached = Counter(
            "kvtier_router:predicted_cached_tokens", "Cached prompt tokens the index predicted, "
            "for requests whose usage reported cached tokens.", registry=r)
        self.actual_cached = Counter(
            "kvtier_router:actual_cached_tokens", "Cached prompt tokens the instances reported "
            "(usage.prompt_tokens_details; serve with --enable-prompt-tokens-details).", registry=r)
        index_blocks = Gauge("kvtier_router:index_blocks", "Blocks in the KV index.", registry=r)
        index_blocks.set_function(index_size)
        evicted = Gauge("kvtier_router:index_evicted_blocks", "Blocks the KV index forgot to stay "
                        "within its bound.", registry=r)
        evicted.set_function(index_evictions)
        self.in_flight = Gauge("kvtier_router:instance_in_flight", "Requests the router has in "
                               "flight on each instance.", ["instance"], registry=r)
        self.queued_tokens = Gauge("kvtier_router:instance_queued_tokens", "Prompt tokens "
                                   "still to compute of the requests the router has sent each "
                                   "instance and seen no first token of.", ["instance"],
                                   registry=r)
        self.reported_load = Gauge("kvtier_router:instance_reported_load", "Requests each "
                                   "instance reports running or waiting.", ["instance"], registry=r)
        self.up = Gauge("kvtier_router:instance_up", "1 while an instance answers its health "
                        "checks.", ["instance"], registry=r)
        self.indexed = Gauge("kvtier_router:instance_indexed", "1 while an instance's KV events "
                             "feed the index.", ["instance"], registry=r)
        self.drops = Counter("kvtier_router:instance_drops", "Times an instance was taken out of "
                             "the index, by reason.", ["instance", "reason"], registry=r)
        self.event_batches = Counter("kvtier_router:event_batches", "KV event batches applied.",
                                     ["instance"], registry=r)
        self.event_gaps = Counter("kvtier_router:event_gaps", "Gaps in an instance's event "
                                  "sequence: detected, replayed or lost.",
                                  ["instance", "outcome"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
