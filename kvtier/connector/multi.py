"""MultiConnector: several connectors behind one, e.g. a fast local store before a shared one.

Loads come from the first child (in config order) that has a hit for the request; saves go to
every child. Each child gets its own metadata, its own shared resource (`create_shared`) and its
own `KVConnectorReport`; the rest of the worker halves' reports is merged into one
`KVConnectorOutput`, which every scheduler child then sees (a child ignores request ids it did
not handle).

Extra config: {"connectors": [<transfer config>, ...]}. A child inherits kv_role,
kv_load_failure_policy and kv_load_timeout_s from the parent unless it sets them.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.connector.base import (
    ConnectorContext,
    KVConnectorBase,
    KVConnectorMetadata,
    KVConnectorOutput,
    KVConnectorReport,
    KVConnectorRole,
    KVConnectorScheduler,
    KVConnectorWorker,
)
from kvtier.connector.config import KVTransferConfig, parse_options
from kvtier.connector.registry import get_connector_class

if TYPE_CHECKING:
    from kvtier.kv import KVCacheBlocks, Request

_INHERITED_KEYS = ("kv_role", "kv_load_failure_policy", "kv_load_timeout_s")


@dataclass(frozen=True)
class MultiConnectorOptions:
    connectors: list[dict[str, Any]]

    def __post_init__(self) -> None:
        if not isinstance(self.connectors, list) or not self.connectors \
                or not all(isinstance(child, dict) for child in self.connectors):
            raise ValueError("MultiConnector extra config: connectors must be a non-empty list "
                             f"of transfer config objects, got {self.connectors!r}")


def child_configs(config: KVTransferConfig) -> list[KVTransferConfig]:
    """The children's transfer configs, in load-preference order."""
    options = parse_options(MultiConnectorOptions, config.kv_connector_extra_config,
                            "MultiConnector extra config")
    inherited = {key: getattr(config, key) for key in _INHERITED_KEYS}
    return [KVTransferConfig.from_dict({**inherited, **child}) for child in options.connectors]


def _create_children(config: KVTransferConfig, role: KVConnectorRole,
                     context: ConnectorContext) -> list:
    children = child_configs(config)
    # One shared resource per child (MultiConnector.create_shared); none without it.
    shared = context.shared or (None,) * len(children)
    return [get_connector_class(child).create(role, child,
                                              dataclasses.replace(context, shared=resource))
            for child, resource in zip(children, shared, strict=True)]


@dataclass
class MultiConnectorMetadata(KVConnectorMetadata):
    children: tuple[KVConnectorMetadata, ...] = ()
    # request id -> how many children send its KV after it finished; it is reported in
    # finished_sending only once all of them are done.
    num_pending_sends: dict[str, int] = field(default_factory=dict)


@dataclass
class MultiConnectorReport(KVConnectorReport):
    # One per child, in child order.
    children: tuple[KVConnectorReport | None, ...] = ()


class MultiConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, context: ConnectorContext) -> None:
        super().__init__(config, context)
        self.children: list[KVConnectorScheduler] = _create_children(
            config, KVConnectorRole.SCHEDULER, context)
        # request id -> index of the child chosen to load it; overwritten on every ask.
        self._load_child: dict[str, int] = {}
        self._pending_sends: dict[str, int] = {}

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        self._load_child.pop(request.request_id, None)
        for index, child in enumerate(self.children):
            num_tokens, is_async = child.get_num_new_matched_tokens(request, num_computed_tokens)
            # A child still looking decides nothing yet: a later child must not win over it.
            if num_tokens is None:
                return None, False
            if num_tokens > 0:
                self._load_child[request.request_id] = index
                return num_tokens, is_async
        return 0, False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        loader = self._load_child.pop(request.request_id, None)
        for index, child in enumerate(self.children):
            # Every child sees the allocation (it may save these blocks); only one loads.
            child.update_state_after_alloc(request, blocks,
                                           num_external_tokens if index == loader else 0)

    def build_connector_meta(self, scheduler_output: Any) -> MultiConnectorMetadata:
        children = tuple(child.build_connector_meta(scheduler_output) for child in self.children)
        meta = MultiConnectorMetadata(children=children, num_pending_sends=self._pending_sends)
        self._pending_sends = {}
        return meta

    def update_connector_output(self, output: KVConnectorOutput) -> None:
        report = output.connector_report
        reports = report.children if isinstance(report, MultiConnectorReport) \
            else (None,) * len(self.children)
        for child, child_report in zip(self.children, reports, strict=True):
            child.update_connector_output(
                dataclasses.replace(output, connector_report=child_report))

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._load_child.pop(request.request_id, None)
        results = [child.request_finished(request, block_ids) for child in self.children]
        num_sending = sum(delay for delay, _ in results)
        if num_sending > 1:
            self._pending_sends[request.request_id] = num_sending
        # The first child with something to say answers the client.
        params = next((params for _, params in results if params is not None), None)
        return num_sending > 0, params

    def take_events(self) -> Iterable[Any]:
        return list(itertools.chain.from_iterable(c.take_events() for c in self.children))

    def shutdown(self) -> None:
        for child in self.children:
            child.shutdown()


class MultiConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, context: ConnectorContext) -> None:
        super().__init__(config, context)
        self.children: list[KVConnectorWorker] = _create_children(
            config, KVConnectorRole.WORKER, context)
        self._sends_left: dict[str, int] = {}

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        super().register_kv_caches(kv_caches)
        for child in self.children:
            child.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata: KVConnectorMetadata) -> None:
        assert isinstance(metadata, MultiConnectorMetadata)
        super().bind_connector_metadata(metadata)
        self._sends_left.update(metadata.num_pending_sends)
        for child, child_meta in zip(self.children, metadata.children, strict=True):
            child.bind_connector_metadata(child_meta)

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        for child in self.children:
            child.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any) -> None:
        for child in self.children:
            child.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        for child in self.children:
            child.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any) -> None:
        for child in self.children:
            child.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        for child in self.children:
            child.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        finished_sending: set[str] = set()
        finished_recving: set[str] = set()
        for child in self.children:
            sending, recving = child.get_finished(finished_req_ids)
            finished_recving |= recving
            finished_sending |= {req_id for req_id in sending if self._last_send_done(req_id)}
        return finished_sending, finished_recving

    def _last_send_done(self, req_id: str) -> bool:
        """One child finished sending `req_id`; True when no other child still is."""
        sends_left = self._sends_left.pop(req_id, 1) - 1
        if sends_left > 0:
            self._sends_left[req_id] = sends_left
        return sends_left == 0

    def get_block_ids_with_load_errors(self) -> set[int]:
        return set().union(*(child.get_block_ids_with_load_errors() for child in self.children))

    def get_stats(self) -> dict[str, float]:
        """Children's stats are counts: the same name from two children adds up."""
        stats: Counter[str] = Counter()
        for child in self.children:
            stats.update(child.get_stats())
        return dict(stats)

    def take_events(self) -> Iterable[Any]:
        return list(itertools.chain.from_iterable(c.take_events() for c in self.children))

    def build_connector_report(self) -> MultiConnectorReport | None:
        reports = tuple(child.build_connector_report() for child in self.children)
        if all(report is None for report in reports):
            return None
        return MultiConnectorReport(children=reports)

    def shutdown(self) -> None:
        for child in self.children:
            child.shutdown()


class MultiConnector(KVConnectorBase):
    scheduler_cls = MultiConnectorScheduler
    worker_cls = MultiConnectorWorker

    @classmethod
    def create_shared(cls, config: KVTransferConfig,
                      context: ConnectorContext) -> tuple[Any, ...]:
        """Each child's own shared resource, in child order."""
        return tuple(get_connector_class(child).create_shared(child, context)
                     for child in child_configs(config))
