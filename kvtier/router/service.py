"""The router's moving parts: instance health and load, event subscriptions, the index.

Every instance is watched by one task: a health check each `health_interval_s`, its load read
from its /metrics, and on coming up its /v1/kv_events_info, whose sockets a subscriber then
follows into the index. An instance failing `max_health_failures` checks in a row is dropped
(out of routing and the index) and keeps being checked, so it comes back when it answers again.
One that should have published (it computed blocks the index did not know) and stayed silent
for `event_timeout_s` leaves the index and is subscribed afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import httpx

from kvtier.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch
from kvtier.events.schema import MEDIUM_GPU
from kvtier.models.errors import ChatTemplateError, ModelLoadError
from kvtier.router.config import RouterConfig
from kvtier.router.index import SHARED_SLOT, KVIndex
from kvtier.router.instances import EventsInfo, Instance
from kvtier.router.metrics import RouterMetrics
from kvtier.router.policy import Router
from kvtier.router.prompts import PromptHasher, load_tokenizer
from kvtier.router.responses import ResponseOwners
from kvtier.router.subscriber import EventSubscriber, instance_endpoint

logger = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 2.0
# The longest wait between reads of an instance's info that failed (kv_events_info,
# kv_transfer_info).
INFO_RETRY_MAX_S = 30.0
# kv_role values of an instance that loads KV other instances computed.
CONSUMER_ROLES = ("kv_consumer", "kv_both")
# The series whose samples (any labels) sum to an instance's load; vLLM's by-reason breakdown
# of the waiting ones (vllm:num_requests_waiting_by_reason) is not counted again.
_LOAD_SERIES = (b"vllm:num_requests_running", b"vllm:num_requests_waiting")


class RouterService:
    def __init__(self, config: RouterConfig) -> None:
        self.config = config
        self.index = KVIndex(config.index_max_blocks, config.tier_weights)
        pools = (("instance", config.instances), ("prefill", config.prefill),
                 ("decode", config.decode))
        roles_urls = [(role, url) for role, urls in pools for url in urls]
        self.instances = [Instance(url.rstrip("/"), slot, role) for slot, (role, url)
                          in enumerate(roles_urls, start=1)]
        # Chooses where requests are answered: any instance, or in P/D mode a decode one.
        self.router = Router(config, [i for i in self.instances if i.role != "prefill"],
                             self.index)
        # In P/D mode, chooses where prompts are computed.
        self.prefill_router = Router(config, [i for i in self.instances if i.role == "prefill"],
                                     self.index) if config.is_disaggregated else None
        # Where each stored response (Responses API) lives.
        self.response_owners = ResponseOwners()
        self.metrics = RouterMetrics(lambda: len(self.index), lambda: self.index.num_evicted)
        self.hasher: PromptHasher | None = None
        self._hashing: tuple[int, str] | None = None
        self._subscriptions: dict[str, asyncio.Task] = {}
        self._hasher_lock = asyncio.Lock()
        self._watchers: list[asyncio.Task] = []
        # The router's own calls to /v1 endpoints (clients' requests carry their own key).
        self.own_headers = {"Authorization": f"Bearer {config.instance_api_key}"} \
            if config.instance_api_key else {}
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(config.read_timeout_s, connect=config.connect_timeout_s),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))

    async def start(self) -> None:
        self._watchers = [asyncio.create_task(self._watch(i)) for i in self.instances]

    async def stop(self) -> None:
        tasks = self._watchers + list(self._subscriptions.values())
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        await self.client.aclose()

    # ---- health and load --------------------------------------------------------------------

    async def _watch(self, instance: Instance) -> None:
        while True:
            try:
                await self.check(instance)
            except Exception:  # one bad answer must not end the watch
                logger.exception("checking %s failed", instance.url)
            await asyncio.sleep(self.config.health_interval_s)

    async def check(self, instance: Instance) -> None:
        """One health check of `instance`, and what follows from it."""
        try:
            response = await self.client.get(f"{instance.url}/health", timeout=HEALTH_TIMEOUT_S)
            ok = response.status_code == 200
        except httpx.HTTPError:
            ok = False
        if not ok:
            instance.num_health_failures += 1
            if instance.healthy and \
                    instance.num_health_failures >= self.config.max_health_failures:
                self.mark_down(instance, "unhealthy")
            return
        instance.num_health_failures = 0
        if not instance.healthy:
            await self._bring_up(instance)
        else:
            if instance.info_retry_at is not None and time.monotonic() >= instance.info_retry_at:
                await self._read_infos(instance, first=False)
            if instance.events is not None and self.hasher is not None:
                await self._read_adapters(instance)
        await self._read_load(instance)
        since = instance.awaiting_events_since
        if instance.indexed and since is not None and \
                time.monotonic() - since > self.config.event_timeout_s:
            self._unindex(instance, "silent")
            self._subscribe(instance)

    def mark_down(self, instance: Instance, reason: str) -> None:
        """Out of routing and the index until its health checks pass again."""
        if instance.healthy:
            logger.warning("instance %s is down (%s)", instance.url, reason)
        instance.healthy = False
        instance.num_health_failures = max(instance.num_health_failures,
                                           self.config.max_health_failures)
        self.metrics.up.labels(instance.url).set(0)
        self._unindex(instance, reason)

    async def _bring_up(self, instance: Instance) -> None:
        instance.events, instance.transport_address = None, None
        instance.info_backoff_s = 0.0
        await self._read_infos(instance, first=True)
        instance.healthy = True
        self.metrics.up.labels(instance.url).set(1)
        logger.info("instance %s is up%s", instance.url,
                    " (KV events indexed)" if instance.indexed else "")

    async def _read_infos(self, instance: Instance, first: bool) -> None:
        """The instance's KV events info and, for a decode instance, its transfer address,
        each read until it is; one that fails (an error answer, a busy instance's timeout) is
        read again at later health checks, backing off up to INFO_RETRY_MAX_S, so one failure
        does not leave an instance unindexed or prefill-less while it stays up. Failures are
        logged the first time only."""
        failed = False
        if instance.events is None:
            events, read = await self._read_events_info(instance, log=first)
            failed |= not read
            instance.events = events
            if events is not None and await self._can_hash_like(instance, events):
                self._subscribe(instance)
        if instance.role == "decode" and instance.transport_address is None:
            instance.transport_address = await self._read_transport_address(instance, first)
            failed |= instance.transport_address is None
        if failed:
            instance.info_backoff_s = min(max(2 * instance.info_backoff_s,
                                              self.config.health_interval_s), INFO_RETRY_MAX_S)
            instance.info_retry_at = time.monotonic() + instance.info_backoff_s
        else:
            instance.info_retry_at = None

    async def _read_events_info(self, instance: Instance,
                                log: bool) -> tuple[EventsInfo | None, bool]:
        """(its events info, None when it publishes none; whether the read succeeded)."""
        try:
            response = await self.client.get(f"{instance.url}/v1/kv_events_info",
                                             headers=self.own_headers, timeout=HEALTH_TIMEOUT_S)
            if response.status_code == 401 and log:
                logger.warning("instance %s wants an API key for its /v1 endpoints: give the "
                               "router --instance-api-key to follow its KV events", instance.url)
            if response.status_code != 200:
                return None, False
            return EventsInfo.from_json(response.json()), True
        except (httpx.HTTPError, ValueError) as exc:
            if log:
                logger.warning("instance %s: no KV events info (%s); routing without its cache "
                               "until it gives it", instance.url, exc)
            return None, False

    async def _read_transport_address(self, instance: Instance, log: bool) -> str | None:
        """A decode instance's P2PConnector address, from its GET /v1/kv_transfer_info."""
        try:
            response = await self.client.get(f"{instance.url}/v1/kv_transfer_info",
                                             headers=self.own_headers, timeout=HEALTH_TIMEOUT_S)
            info = response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            info = None
        address = info.get("transport_address") if isinstance(info, dict) else None
        if not isinstance(address, str) or info.get("kv_role") not in CONSUMER_ROLES:
            if not log:
                return None
            logger.error("decode instance %s reports no P2PConnector consumer address (serve it "
                         "with --kv-transfer-config '{\"kv_connector\": \"P2PConnector\", "
                         "\"kv_role\": \"kv_consumer\"}'): it computes every prompt itself "
                         "until it gives one",
                         instance.url)
            return None
        return instance_endpoint(address, instance.url)

    async def _can_hash_like(self, instance: Instance, events: EventsInfo) -> bool:
        """Whether this instance hashes blocks as the router does (the first one decides)."""
        hashing = (events.block_size, events.hash_algo)
        async with self._hasher_lock:  # instances coming up together load one tokenizer
            if self.hasher is None:
                await self._load_hasher(events)
        if self.hasher is None:
            return False
        if hashing != self._hashing:
            logger.error("instance %s hashes blocks with block_size=%d hash_algo=%s, not %s: "
                         "its KV events are ignored", instance.url, *hashing, self._hashing)
            return False
        self.hasher.add_adapters(events.lora_adapters)
        return True

    async def _load_hasher(self, events: EventsInfo) -> None:
        model = self.config.model or events.model
        try:
            tokenizer = await asyncio.to_thread(load_tokenizer, model)
            if tokenizer is not None and events.chat_template is not None:
                tokenizer.set_chat_template(events.chat_template)  # the instance's own
        except (ModelLoadError, ChatTemplateError, OSError) as exc:
            logger.error("cannot load the tokenizer of %s (%s): routing without the KV index; "
                         "pass --model", model, exc)
            return
        self.hasher = PromptHasher(tokenizer, events.block_size, events.hash_algo)
        self._hashing = (events.block_size, events.hash_algo)

    async def _read_adapters(self, instance: Instance) -> None:
        """The instance's LoRA adapters now, loaded at run time too, for the prompt hasher."""
        try:
            response = await self.client.get(f"{instance.url}/v1/kv_events_info",
                                             headers=self.own_headers, timeout=HEALTH_TIMEOUT_S)
            events = EventsInfo.from_json(response.json()) if response.status_code == 200 \
                else None
        except (httpx.HTTPError, ValueError):
            return  # the health checks judge the instance; its adapters keep their last keys
        if events is not None:
            self.hasher.add_adapters(events.lora_adapters)

    async def _read_load(self, instance: Instance) -> None:
        try:
            response = await self.client.get(f"{instance.url}/metrics", timeout=HEALTH_TIMEOUT_S)
        except httpx.HTTPError:
            return
        load = 0.0
        for line in response.content.splitlines():
            name = line.split(b"{", 1)[0].split(b" ", 1)[0]
            if name in _LOAD_SERIES:
                with contextlib.suppress(ValueError, IndexError):
                    load += float(line.rsplit(b" ", 1)[1])
        instance.reported_load = int(load)
        self.metrics.reported_load.labels(instance.url).set(load)

    def add_in_flight(self, instance: Instance, delta: int) -> None:
        instance.in_flight += delta
        self.metrics.in_flight.labels(instance.url).set(instance.in_flight)

    def add_queued_tokens(self, instance: Instance, delta: int) -> None:
        instance.queued_tokens += delta
        self.metrics.queued_tokens.labels(instance.url).set(instance.queued_tokens)

    def expect_events(self, instance: Instance, num_new_blocks: int) -> None:
        """`instance` computed `num_new_blocks` blocks the index did not know it had: it owes
        the index their events (see `check`)."""
        if instance.indexed and num_new_blocks > 0 and instance.awaiting_events_since is None:
            instance.awaiting_events_since = time.monotonic()

    # ---- events -------------------------------------------------------------------------------

    def _subscribe(self, instance: Instance) -> None:
        events = instance.events
        assert events is not None
        replay = events.replay_endpoint
        subscriber = EventSubscriber(
            instance_endpoint(events.endpoint, instance.url),
            instance_endpoint(replay, instance.url) if replay else None, events.topic,
            apply=lambda batch: self.apply(instance, batch),
            reset=lambda outcome: self._reset(instance, outcome),
            on_gap=lambda outcome: self.metrics.event_gaps.labels(instance.url, outcome).inc())
        self._subscriptions[instance.url] = asyncio.create_task(subscriber.run())
        instance.indexed = True
        instance.awaiting_events_since = None
        self.metrics.indexed.labels(instance.url).set(1)

    def _unindex(self, instance: Instance, reason: str) -> None:
        task = self._subscriptions.pop(instance.url, None)
        if task is not None:
            task.cancel()
        if instance.indexed:
            self.metrics.drops.labels(instance.url, reason).inc()
        instance.indexed = False
        self.metrics.indexed.labels(instance.url).set(0)
        self.index.clear(instance.slot)

    def _reset(self, instance: Instance, outcome: str) -> None:
        """Events of `instance` were lost: what it holds is forgotten, and so are the shared
        stores' blocks (any instance publishes their removals; this one's may be among the
        lost), until events tell them again."""
        self.metrics.drops.labels(instance.url, f"events_{outcome}").inc()
        self.index.clear(instance.slot)
        self.index.clear(SHARED_SLOT)

    def apply(self, instance: Instance, batch: EventBatch) -> None:
        """One batch of `instance`'s events into the index."""
        slot = instance.slot
        for event in batch.events:
            if isinstance(event, BlockStored):
                self.index.store(slot, event.block_hashes, event.medium, event.locality)
            elif isinstance(event, BlockRemoved):
                self.index.remove(slot, event.block_hashes, event.medium, event.locality)
            elif isinstance(event, AllBlocksCleared):
                self.index.clear(slot, MEDIUM_GPU)
        instance.last_event_at = time.monotonic()
        instance.awaiting_events_since = None
        self.metrics.event_batches.labels(instance.url).inc()
