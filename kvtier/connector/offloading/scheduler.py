"""OffloadingConnector, scheduler half: which chunks to load from and store to the host tier.

Lookups walk a waiting request's chunks left to right from its local prefix hit: host hits
and chunks a tier can hand over from its mapped file (MAPPED) extend the answer, a chunk on its
way up from a secondary tier makes the answer None (RETRY: the scheduler asks again next step;
for at most `tier_job_timeout_s`, then the host's chunks are taken as they are), the first miss
ends it. An answer therefore only counts chunks in memory, and their load is synchronous: the
worker copies them before the forward of the step that admits the request. Stores are planned
every step for the chunks that became full, the prompt's and (unless `offload_prompt_only`)
those decoding fills, which a conversation's next turn starts with; the worker copies them after
the forward and the cascade to secondary tiers starts when the copy is reported.

Hybrid models: each group's lookups and loads take the chunks it needs (group_chunks.py); where
one of them misses, the hit ends at the last chunk they all have.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from kvtier.connector.base import ConnectorContext, KVConnectorScheduler
from kvtier.connector.offloading.event_names import TierEventNames
from kvtier.connector.offloading.group_chunks import GroupChunks
from kvtier.connector.offloading.metadata import (
    BatchDone,
    ChunkTransfer,
    OffloadingConnectorMetadata,
    OffloadingConnectorReport,
)
from kvtier.connector.offloading.shared import shared_of
from kvtier.events import WireEvent
from kvtier.offload.config import OffloadConfig
from kvtier.offload.keys import ChunkKey, chunk_identity, make_chunk_key
from kvtier.offload.manager import Lookup, TieringManager
from kvtier.offload.tiers.base import MappedChunk

# Shutdown's flush waits for the tier jobs' own deadline plus this long.
_FLUSH_MARGIN_S = 1.0


@dataclass
class _Plan:
    """A lookup's answer, kept for update_state_after_alloc in the same schedule() call."""

    num_local_tokens: int
    end_chunk: int


@dataclass
class _RequestState:
    """What this half knows about one request, from its first lookup to request_finished."""

    request: Any
    # Device block ids per group as handed out so far; None until first admitted.
    block_ids: list[list[int]] | None = None
    # Chunks before this one were already planned for storing.
    next_store_chunk: int = 0
    # Chunks before this one were counted as used by this request (store_threshold): those
    # whole at admission then, the ones decoding fills as they fill.
    num_used_chunks: int = 0
    plan: _Plan | None = None
    # (group, chunk) pairs looked up (the tier counters count a re-ask while promoted once).
    asked: set[tuple[int, int]] = field(default_factory=set)
    # When a lookup first answered RETRY; None while not waiting for promotions.
    retrying_since: float | None = None
    # Chunks the last lookup started (or found) on their way up from a tier, in scan order.
    promoting: list[ChunkKey] = field(default_factory=list)
    # The last lookup also answered RETRY for a chunk not on its way up (a tier that cannot
    # tell yet, no host slot free): ask again next step, whatever `promoting` holds.
    rescan: bool = False
    # Per group, the request's chunk keys, made once for its lookups, loads, stores and uses.
    keys: dict[int, list[ChunkKey]] = field(default_factory=dict)


class OffloadingConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: Any, context: ConnectorContext) -> None:
        super().__init__(config, context)
        shared = shared_of(context)
        self.options: OffloadConfig = config.options  # parsed with the engine's config
        self.layouts = shared.layouts
        identity = chunk_identity(context.kv_identity, self.options.blocks_per_chunk)
        self.namespace = identity.namespace
        self.manager = TieringManager(self.options, self.namespace, shared.area,
                                      metrics_registry=context.metrics,
                                      description=identity.describe(), watch=shared.watch)
        self.block_size = context.block_size
        groups = context.kv_cache_config.kv_cache_groups
        self.chunks = GroupChunks([group.kv_cache_spec for group in groups], self.layouts,
                                  self.block_size, self.options.blocks_per_chunk)
        self.chunk_tokens = self.chunks.chunk_tokens
        self._job_ids = itertools.count()
        self._states: dict[str, _RequestState] = {}
        self._pending_loads: list[ChunkTransfer] = []
        # Copies handed to the worker half and not yet reported: job id -> chunk, and what a
        # load straight from a tier's mapped file pinned.
        self._transfers: dict[int, tuple[ChunkKey, MappedChunk | None]] = {}
        # None when the engine publishes no events (then no chunk is named, no event made).
        self._event_names = TierEventNames(
            self.options, self.block_size, shared.area.num_slots,
            self.chunks.scan_groups()[0]) if context.kv_events else None

    def _state(self, request: Any) -> _RequestState:
        state = self._states.get(request.request_id)
        if state is None:
            state = self._states[request.request_id] = _RequestState(request)
        return state

    # ---- keys and lookups ------------------------------------------------------------------

    def _key(self, state: _RequestState, group_id: int, chunk: int) -> ChunkKey:
        """The request's chunk key, made (and named for events) the first time it is asked."""
        return self._keys(state, group_id, chunk + 1)[chunk]

    def _keys(self, state: _RequestState, group_id: int, end: int) -> list[ChunkKey]:
        """The request's keys of the group's chunks up to `end` at least (made once each)."""
        keys = state.keys.setdefault(group_id, [])
        if len(keys) < end:
            keys.extend(self.chunk_keys(state.request, group_id, len(keys), end))
        return keys

    def chunk_keys(self, request: Any, group_id: int, start: int, end: int) -> list[ChunkKey]:
        """The keys of the request's chunks in [start, end) of the group."""
        per_chunk, hashes = self.options.blocks_per_chunk, request.block_hashes
        prefix = make_chunk_key(self.namespace, group_id, b"")  # what every key starts with
        keys = [ChunkKey(prefix + hashes[(c + 1) * per_chunk - 1]) for c in range(start, end)]
        if self._event_names is not None:
            self._event_names.name(group_id, start, keys, hashes)
        return keys

    def _lookup(self, state: _RequestState, group_id: int, chunk: int) -> Lookup:
        first = (group_id, chunk) not in state.asked
        state.asked.add((group_id, chunk))
        key = self._key(state, group_id, chunk)
        answer = self.manager.lookup(key, self.layouts[group_id].chunk_bytes,
                                     state.request.request_id, record=first)
        if answer is Lookup.RETRY:
            if self.manager.is_promoting(key):
                state.promoting.append(key)
            else:
                state.rescan = True
        return answer

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        # The last token is always recomputed (its logits give the next token).
        num_loadable_blocks = min(len(request.block_hashes),
                                  (request.num_tokens - 1) // self.block_size)
        num_chunks = num_loadable_blocks // self.options.blocks_per_chunk
        start = num_computed_tokens // self.chunk_tokens
        end, retry = start, False
        state = self._state(request)
        # Waited a whole tier-job deadline: take what host memory holds now. Without this, a
        # request with more chunks on a tier than the host has slots waits forever, each
        # step's promotions evicting the previous step's.
        settle = self._waited_too_long(state)
        if not settle and self._still_promoting(state):
            return None, False
        state.promoting, state.rescan = [], False
        scan = self.chunks.scan_groups()
        with self.manager.promotions():  # the tiers get the walk's promotions in one call
            end = self._run(state, scan, start, num_chunks, Lookup.HIT)
            end = self._run(state, scan, end, num_chunks, Lookup.MAPPED)
            for chunk in range(end, num_chunks):
                # Past a RETRY the scan goes on, so every chunk on a tier is promoted at once.
                answers = [self._lookup(state, g, chunk) for g in scan]  # no enum hashing
                if Lookup.MISS in answers or (settle and Lookup.RETRY in answers):
                    break
                retry = retry or Lookup.RETRY in answers
                end = chunk + 1
            end, others_retry = self._end_for_other_groups(state, scan, start, end, settle)
        retry = retry or others_retry
        if retry and end > start:
            if state.retrying_since is None:
                state.retrying_since = time.monotonic()
            return None, False
        state.promoting = []
        num_tokens = end * self.chunk_tokens - num_computed_tokens
        if num_tokens <= 0:
            return 0, False
        state.plan = _Plan(num_computed_tokens, end)
        return num_tokens, False  # every chunk is in host memory: loaded before the forward

    def _run(self, state: _RequestState, scan: list[int], start: int, end: int,
             answer: Lookup) -> int:
        """The end of the run of chunks from `start` that `_lookup` would answer `answer` (HIT
        or MAPPED) for every group of `scan`, found in one pass (chunk by chunk, an 8k-token
        prompt's lookup cost ~1 ms in host memory, ~3 ms in the disk tier's file)."""
        for g in scan:
            keys = self._keys(state, g, end)[start:end]
            end = start + (self.manager.host.count_ready(keys) if answer is Lookup.HIT else
                           self.manager.num_mapped(keys, self.layouts[g].chunk_bytes))
        asked = [(g, chunk) for g in scan for chunk in range(start, end)]
        num_first = len(asked) - len(state.asked.intersection(asked))
        state.asked.update(asked)
        if num_first:
            self.manager.count_lookups(answer, num_first)
        return end

    def _end_for_other_groups(self, state: _RequestState, scan: list[int], start: int,
                              end: int, settle: bool) -> tuple[int, bool]:
        """The last end <= `end` at which every group outside `scan` has the chunks it needs
        (a window's, a recurrent state's), and whether one of them is still on its way up."""
        others = [g for g in range(len(self.chunks)) if g not in scan]
        while end > start and others:
            answers = [self._lookup(state, g, c)
                       for g in others for c in self.chunks.needed(g, start, end)]
            if Lookup.MISS not in answers and not (settle and Lookup.RETRY in answers):
                return end, Lookup.RETRY in answers
            end -= 1
        return end, False

    def _still_promoting(self, state: _RequestState) -> bool:
        """A chunk the last lookup saw on its way up has not arrived yet, so a new scan would
        answer None again. Checked instead of that scan: an 8k-token prompt's scan holds the
        engine thread (and the GIL the tier's read threads need between their reads) for ~2
        ms each step, which made its promotions ~4x slower. Most recent first: promotions end
        about in the order they started, so each chunk is checked about once in all. The
        promotions that ended since the last step's poll are collected first: an idle engine
        wakes when the last one ends (PromotionWatch), and this step can then admit."""
        if state.rescan:
            return False
        promoting = state.promoting
        if promoting and self.manager.is_promoting(promoting[-1]):
            self.manager.collect()
        while promoting and not self.manager.is_promoting(promoting[-1]):
            promoting.pop()
        return bool(promoting)

    def _waited_too_long(self, state: _RequestState) -> bool:
        since = state.retrying_since
        return since is not None and time.monotonic() - since > self.options.tier_job_timeout_s

    # ---- loads -------------------------------------------------------------------------------

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        state = self._state(request)
        state.retrying_since = None  # admitted: a later ask (after a preemption) may wait
        block_ids = [list(ids) for ids in blocks.get_block_ids()]
        if state.block_ids is None:
            self._record_uses(state, len(request.block_hashes) // self.options.blocks_per_chunk)
        state.block_ids = block_ids
        plan, state.plan = state.plan, None
        if plan is None or num_external_tokens == 0:
            return
        first_block = plan.num_local_tokens // self.block_size
        end_block = (plan.num_local_tokens + num_external_tokens) // self.block_size
        start = first_block // self.options.blocks_per_chunk
        end = -(-end_block // self.options.blocks_per_chunk)
        num_planned = len(self._pending_loads)
        self._plan_loads(state, [(g, chunk) for g in range(len(self.chunks))
                                 for chunk in self.chunks.needed(g, start, end)],
                         block_ids, first_block, end_block)
        if all(load.slot is not None or load.mapped is not None
               for load in self._pending_loads[num_planned:]):
            # What it loads is in memory: no store to plan for those chunks (an 8k-token
            # hit's 511 would each be asked for nothing). A chunk that left host memory since
            # the lookup is recomputed, and stored then.
            state.next_store_chunk = max(state.next_store_chunk, end)

    def _plan_loads(self, state: _RequestState, chunks: list[tuple[int, int]],
                    block_ids: list[list[int]], first_block: int, end_block: int) -> None:
        """Copies of `chunks` ((group, chunk) pairs) into the request's blocks in [first_block,
        end_block): from their host slots, pinned in one call, or from a tier's mapped file."""
        planned = []
        for g, chunk in chunks:
            offsets, ids = self.chunks.blocks_of_chunk(g, chunk, block_ids[g], first_block,
                                                       end_block)
            if ids:
                planned.append((g, offsets, ids, self._key(state, g, chunk)))
        # A chunk not in host memory: a MAPPED answer, or a HIT another request's promotion
        # evicted since (then no slot and no mapping: the worker fails it, it is recomputed).
        slots = self.manager.prepare_loads([key for *_, key in planned])
        pins = iter(self.manager.queries.pin_mapped([
            (key, self.layouts[g].chunk_bytes)
            for (g, *_, key), slot in zip(planned, slots) if slot is None]))
        for (g, offsets, ids, key), slot in zip(planned, slots):
            pin = None if slot is not None else next(pins)
            transfer = ChunkTransfer(next(self._job_ids), state.request.request_id, g, slot,
                                     offsets, ids, pin)
            self._pending_loads.append(transfer)
            if slot is not None or pin is not None:
                self._transfers[transfer.job_id] = key, pin

    # ---- stores and the step's metadata ------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> OffloadingConnectorMetadata:
        self.manager.poll()
        stores: list[ChunkTransfer] = []
        for data in scheduler_output.scheduled_new_reqs:
            state = self._states.get(data.req_id)
            if state is not None:
                state.block_ids = [list(ids) for ids in data.block_ids]
                self._plan_stores(state, data.num_computed_tokens, scheduler_output, stores)
        for data in scheduler_output.scheduled_cached_reqs:
            state = self._states.get(data.req_id)
            if state is not None and state.block_ids is not None:
                for ids, new_ids in zip(state.block_ids, data.new_block_ids):
                    ids.extend(new_ids)
                self._plan_stores(state, data.num_computed_tokens, scheduler_output, stores)
        metadata = OffloadingConnectorMetadata(loads=self._pending_loads, stores=stores)
        self._pending_loads = []
        if scheduler_output.is_empty:  # only a step with nothing to compute waits on the watch
            self._tell_watch()
        return metadata

    def _tell_watch(self) -> None:
        """Tell the promotion watch which promotions each waiting request still needs, so an
        idle engine sleeps until one of them has all it asked for."""
        needs, poll = [], False
        for state in self._states.values():
            if not state.promoting and not state.rescan:
                continue  # its last answer was not RETRY (or it was never asked)
            jobs = None if state.rescan else self.manager.promotion_jobs(state.promoting)
            if jobs is None:
                poll = True
            else:
                needs.append(jobs)
        self.manager.watch.expect(needs, poll)

    def _plan_stores(self, state: _RequestState, num_computed_tokens: int,
                     scheduler_output: Any, stores: list[ChunkTransfer]) -> None:
        request = state.request
        num_tokens = num_computed_tokens + scheduler_output.num_scheduled_tokens.get(
            request.request_id, 0)
        if self.options.offload_prompt_only:
            num_tokens = min(num_tokens, request.num_prompt_tokens)
        num_blocks = min(len(request.block_hashes), num_tokens // self.block_size)
        num_chunks = num_blocks // self.options.blocks_per_chunk
        # Without this, a chunk filled by decoding counts no use and never meets the threshold.
        self._record_uses(state, num_chunks)
        for chunk in range(state.next_store_chunk, num_chunks):
            for g in range(len(self.chunks)):
                self._plan_store(state, g, chunk, state.block_ids[g], stores)
        state.next_store_chunk = max(state.next_store_chunk, num_chunks)

    def _record_uses(self, state: _RequestState, num_chunks: int) -> None:
        """Count this request's use of its chunks before `num_chunks` (each chunk once), where
        store_threshold needs more than the one use every stored chunk has."""
        for chunk in range(state.num_used_chunks, num_chunks):
            for g in range(len(self.chunks)) if self.options.store_threshold > 1 else ():
                self.manager.record_use(self._key(state, g, chunk))
        state.num_used_chunks = max(state.num_used_chunks, num_chunks)

    def _plan_store(self, state: _RequestState, group_id: int, chunk: int,
                    block_ids: list[int], stores: list[ChunkTransfer]) -> None:
        per_chunk = self.options.blocks_per_chunk
        offsets, ids = self.chunks.blocks_of_chunk(group_id, chunk, block_ids, chunk * per_chunk,
                                             (chunk + 1) * per_chunk)
        if len(ids) != self.layouts[group_id].blocks_per_chunk:
            return  # part of it is gone (outside a sliding window): no whole chunk to store
        key = self._key(state, group_id, chunk)
        slot = self.manager.prepare_store(key, self.layouts[group_id].chunk_bytes)
        if slot is None:
            return
        job_id = next(self._job_ids)
        self._transfers[job_id] = key, None
        stores.append(ChunkTransfer(job_id, state.request.request_id, group_id, slot, offsets,
                                    ids))

    # ---- reports, finishing, events ----------------------------------------------------------

    def update_connector_output(self, output: Any) -> None:
        report = output.connector_report
        if isinstance(report, OffloadingConnectorReport):
            for done in report.batches:
                self._complete(done)
            self.manager.metrics.flush()  # the step's last word on /metrics until the next

    def _complete(self, done: BatchDone) -> None:
        """The worker finished a batch of copies: the chunks' host slots are theirs again
        (a store that worked goes on to the secondary tiers)."""
        if done.ok:
            self.manager.metrics.transfer(done.direction, done.num_bytes, done.seconds,
                                          done.ended)
        else:  # a copy from or to the host, or from a tier's mapped file, failed
            source = done.direction.rsplit("_to_", 1)[0]
            self.manager.metrics.error("host" if source == "device" else source)
        loaded = []
        for job_id in done.job_ids:
            key, mapped = self._transfers.pop(job_id)
            if done.direction == "device_to_host":
                self.manager.complete_store(key, done.ok)
            elif mapped is not None:
                self.manager.queries.release_mapped(mapped, key, done.ok)
            else:
                loaded.append(key)
        if loaded:
            self.manager.complete_loads(loaded, done.ok)

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Stores never need the blocks kept: the worker fences them before the next forward;
        # its copies in flight are tracked by job, so they end well without it.
        self._states.pop(request.request_id, None)
        return False, None

    def take_events(self) -> list[WireEvent]:
        """The tier moves as wire events, named by the chunks' block hashes. Only the event
        group's chunks are published (every group of a hybrid model holds the same blocks)."""
        moves = self.manager.take_events()
        return [] if self._event_names is None else self._event_names.wire_events(moves)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Send every chunk in host memory that the tiers lack on its way (write_back
        included) and wait until every tier job has ended or missed its deadline, for at most
        `timeout_s` (default: one tier-job deadline and a margin). Copies from the device
        count once the worker half has reported them. False if the wait ran out or a copy is
        still unreported."""
        if timeout_s is None:
            timeout_s = self.options.tier_job_timeout_s + _FLUSH_MARGIN_S
        return self.manager.flush(timeout_s) and not self._transfers

    def shutdown(self) -> None:
        # Called after the worker half's last report: what this instance computed reaches the
        # shared tiers, within the tier-job deadline.
        self.flush()
        self.manager.shutdown()
