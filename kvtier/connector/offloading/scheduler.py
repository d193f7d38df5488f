"""OffloadingConnector, scheduler half: which chunks to load from and store to the host tier.

Lookups walk a waiting request's chunks left to right from its local prefix hit: host hits
extend the answer, a chunk on its way up from a secondary tier makes the answer None (RETRY: the
scheduler asks again next step; for at most `tier_job_timeout_s`, then the host's chunks are
taken as they are), the first miss ends it. Stores are planned every step for the
chunks that became full; the worker copies them after the forward and the cascade to secondary
tiers starts when the copy is reported.

Hybrid models: a full-attention group needs every chunk of the hit, a sliding-window group only
the chunks its window reaches at the end of the hit, a Mamba group only the last one; blocks the
device cache has already replaced by the null block are never loaded into.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

from kvtier.connector.base import ConnectorContext, KVConnectorScheduler
from kvtier.connector.offloading.metadata import ChunkTransfer, OffloadingConnectorMetadata
from kvtier.connector.offloading.session import close_session, open_session
from kvtier.kv import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvtier.offload.config import OffloadConfig
from kvtier.offload.keys import ChunkKey, chunk_identity, make_chunk_key
from kvtier.offload.layout import ChunkLayout
from kvtier.offload.manager import Lookup, TieringManager

_NULL_BLOCK_ID = 0


@dataclass
class _RequestState:
    request: Any
    # Device block ids per group, as the scheduler has handed them out so far.
    block_ids: list[list[int]]
    # Chunks before this one were already planned for storing.
    next_store_chunk: int = 0


@dataclass
class _Plan:
    """A lookup's answer, kept for update_state_after_alloc in the same schedule() call."""

    num_local_tokens: int
    end_chunk: int


@dataclass
class _Load:
    key: ChunkKey
    block_ids: tuple[int, ...]


class OffloadingConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: Any, context: ConnectorContext) -> None:
        super().__init__(config, context)
        if context.kv_cache_config is None:
            raise ValueError("OffloadingConnector needs ConnectorContext.kv_cache_config (the "
                             "engine passes its KVCacheConfig)")
        self.options: OffloadConfig = config.options  # parsed with the engine's config
        self.groups = [g.kv_cache_spec for g in context.kv_cache_config.kv_cache_groups]
        self.layouts = tuple(
            ChunkLayout(spec.page_size_bytes, len(g.layer_names), self.options.blocks_per_chunk)
            for g, spec in zip(context.kv_cache_config.kv_cache_groups, self.groups))
        identity = chunk_identity(context.kv_identity, self.options.blocks_per_chunk)
        self.namespace = identity.namespace
        self.manager = TieringManager(self.options, self.namespace,
                                      [layout.chunk_bytes for layout in self.layouts],
                                      metrics_registry=context.metrics,
                                      description=identity.describe())
        self.session = open_session(self.manager, self.layouts)
        self.block_size = context.block_size
        self.chunk_tokens = self.block_size * self.options.blocks_per_chunk
        self._job_ids = itertools.count()
        self._requests: dict[str, _RequestState] = {}
        self._plans: dict[str, _Plan] = {}
        self._pending_loads: list[ChunkTransfer] = []
        self._loading: dict[str, list[_Load]] = {}
        self._storing: dict[int, ChunkKey] = {}
        self._asked: dict[str, set[tuple[int, int]]] = {}  # (group, chunk) looked up per request
        self._retrying: dict[str, float] = {}  # when each request was first answered RETRY

    # ---- keys and lookups ------------------------------------------------------------------

    def chunk_key(self, request: Any, group_id: int, chunk: int) -> ChunkKey:
        last_block = (chunk + 1) * self.options.blocks_per_chunk - 1
        return make_chunk_key(self.namespace, group_id, request.block_hashes[last_block])

    def _scan_groups(self) -> list[int]:
        full = [g for g, spec in enumerate(self.groups) if isinstance(spec, FullAttentionSpec)]
        return full or [0]

    def _needed_chunks(self, group_id: int, start: int, end: int) -> range:
        """Chunks of [start, end) that `group_id` needs to continue from chunk `end`."""
        spec = self.groups[group_id]
        if isinstance(spec, SlidingWindowSpec):
            first_token = max(0, end * self.chunk_tokens - spec.sliding_window + 1)
            return range(max(start, first_token // self.chunk_tokens), end)
        if isinstance(spec, MambaSpec):
            return range(max(start, end - 1), end)
        return range(start, end)

    def _lookup(self, request: Any, group_id: int, chunk: int) -> Lookup:
        # A request re-asks while its chunks are promoted: the tier counters count it once.
        asked = self._asked.setdefault(request.request_id, set())
        first = (group_id, chunk) not in asked
        asked.add((group_id, chunk))
        return self.manager.lookup(self.chunk_key(request, group_id, chunk),
                                   self.layouts[group_id].chunk_bytes, request.request_id,
                                   record=first)

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        # The last token is always recomputed (its logits give the next token).
        num_loadable_blocks = min(len(request.block_hashes),
                                  (request.num_tokens - 1) // self.block_size)
        num_chunks = num_loadable_blocks // self.options.blocks_per_chunk
        start = num_computed_tokens // self.chunk_tokens
        end, retry = start, False
        # Waited a whole tier-job deadline: take what host memory holds now. Without this, a
        # request with more chunks on a tier than the host has slots waits forever, each
        # step's promotions evicting the previous step's.
        settle = self._waited_too_long(request.request_id)
        scan = self._scan_groups()
        for chunk in range(start, num_chunks):
            # Past a RETRY the scan goes on, so every chunk on a tier is promoted at once.
            answers = {self._lookup(request, g, chunk) for g in scan}
            if Lookup.MISS in answers or (settle and Lookup.RETRY in answers):
                break
            retry = retry or Lookup.RETRY in answers
            end = chunk + 1
        others = [g for g in range(len(self.groups)) if g not in scan]
        for g in others:
            answers = {self._lookup(request, g, c) for c in self._needed_chunks(g, start, end)}
            if Lookup.MISS in answers or (settle and Lookup.RETRY in answers):
                end = start
            retry = retry or Lookup.RETRY in answers
        if retry and end > start:
            self._retrying.setdefault(request.request_id, time.monotonic())
            return None, False
        num_tokens = end * self.chunk_tokens - num_computed_tokens
        if num_tokens <= 0:
            return 0, False
        self._plans[request.request_id] = _Plan(num_computed_tokens, end)
        return num_tokens, True

    def _waited_too_long(self, req_id: str) -> bool:
        since = self._retrying.get(req_id)
        return since is not None and time.monotonic() - since > self.options.tier_job_timeout_s

    # ---- loads -------------------------------------------------------------------------------

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        req_id = request.request_id
        self._retrying.pop(req_id, None)  # admitted: a later ask (after a preemption) may wait
        block_ids = [list(ids) for ids in blocks.get_block_ids()]
        if req_id not in self._requests:
            self._requests[req_id] = _RequestState(request, block_ids)
            num_chunks = len(request.block_hashes) // self.options.blocks_per_chunk
            for chunk in range(num_chunks):
                for g in range(len(self.groups)):
                    self.manager.record_use(self.chunk_key(request, g, chunk))
        else:
            self._requests[req_id].block_ids = block_ids
        plan = self._plans.pop(req_id, None)
        if plan is None or num_external_tokens == 0:
            return
        first_block = plan.num_local_tokens // self.block_size
        end_block = (plan.num_local_tokens + num_external_tokens) // self.block_size
        start = first_block // self.options.blocks_per_chunk
        end = -(-end_block // self.options.blocks_per_chunk)
        for g in range(len(self.groups)):
            for chunk in self._needed_chunks(g, start, end):
                self._plan_load(request, g, chunk, block_ids[g], first_block, end_block)

    def _plan_load(self, request: Any, group_id: int, chunk: int, block_ids: list[int],
                   first_block: int, end_block: int) -> None:
        offsets, ids = self._blocks_of_chunk(chunk, block_ids, first_block, end_block)
        if not ids:
            return
        key = self.chunk_key(request, group_id, chunk)
        # Another request's promotion may have evicted it since this request's lookup.
        slot = self.manager.prepare_load(key) if self.manager.host.is_ready(key) else None
        transfer = ChunkTransfer(next(self._job_ids), request.request_id, group_id, slot,
                                 offsets, ids)
        self._pending_loads.append(transfer)
        if slot is not None:
            self._loading.setdefault(request.request_id, []).append(_Load(key, ids))

    def _blocks_of_chunk(self, chunk: int, block_ids: list[int], first_block: int,
                         end_block: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets in the chunk, device block ids) of the chunk's blocks in
        [first_block, end_block), leaving out null blocks (outside a sliding window)."""
        per_chunk = self.options.blocks_per_chunk
        offsets, ids = [], []
        for offset in range(per_chunk):
            index = chunk * per_chunk + offset
            if first_block <= index < min(end_block, len(block_ids)) \
                    and block_ids[index] != _NULL_BLOCK_ID:
                offsets.append(offset)
                ids.append(block_ids[index])
        return tuple(offsets), tuple(ids)

    # ---- stores and the step's metadata ------------------------------------------------------

    def build_connector_meta(self, scheduler_output: Any) -> OffloadingConnectorMetadata:
        self._collect_worker_reports()
        self.manager.poll()
        stores: list[ChunkTransfer] = []
        for data in scheduler_output.scheduled_new_reqs:
            state = self._requests.get(data.req_id)
            if state is not None:
                state.block_ids = [list(ids) for ids in data.block_ids]
                self._plan_stores(state, data.num_computed_tokens, scheduler_output, stores)
        for data in scheduler_output.scheduled_cached_reqs:
            state = self._requests.get(data.req_id)
            if state is not None:
                for ids, new_ids in zip(state.block_ids, data.new_block_ids):
                    ids.extend(new_ids)
                self._plan_stores(state, data.num_computed_tokens, scheduler_output, stores)
        metadata = OffloadingConnectorMetadata(self.session.session_id,
                                               loads=self._pending_loads, stores=stores)
        self._pending_loads = []
        return metadata

    def _plan_stores(self, state: _RequestState, num_computed_tokens: int,
                     scheduler_output: Any, stores: list[ChunkTransfer]) -> None:
        request = state.request
        num_tokens = num_computed_tokens + scheduler_output.num_scheduled_tokens.get(
            request.request_id, 0)
        if self.options.offload_prompt_only:
            num_tokens = min(num_tokens, request.num_prompt_tokens)
        num_blocks = min(len(request.block_hashes), num_tokens // self.block_size)
        num_chunks = num_blocks // self.options.blocks_per_chunk
        for chunk in range(state.next_store_chunk, num_chunks):
            for g in range(len(self.groups)):
                self._plan_store(request, g, chunk, state.block_ids[g], stores)
        state.next_store_chunk = max(state.next_store_chunk, num_chunks)

    def _plan_store(self, request: Any, group_id: int, chunk: int, block_ids: list[int],
                    stores: list[ChunkTransfer]) -> None:
        per_chunk = self.options.blocks_per_chunk
        offsets, ids = self._blocks_of_chunk(chunk, block_ids, chunk * per_chunk,
                                             (chunk + 1) * per_chunk)
        if len(ids) != per_chunk:
            return  # part of it is gone (outside a sliding window): no whole chunk to store
        key = self.chunk_key(request, group_id, chunk)
        slot = self.manager.prepare_store(key, self.layouts[group_id].chunk_bytes)
        if slot is None:
            return
        job_id = next(self._job_ids)
        self._storing[job_id] = key
        stores.append(ChunkTransfer(job_id, request.request_id, group_id, slot, offsets, ids))

    def _collect_worker_reports(self) -> None:
        completions = self.session.completions
        while not completions.empty():
            done = completions.get_nowait()
            if done.ok:
                self.manager.metrics.transfer(done.direction, done.num_bytes, done.seconds,
                                              done.ended)
            else:
                self.manager.metrics.error("host")
            for job_id in done.job_ids:
                self.manager.complete_store(self._storing.pop(job_id), done.ok)

    # ---- reports, finishing, events ----------------------------------------------------------

    def update_connector_output(self, output: Any) -> None:
        self._collect_worker_reports()
        for req_id in output.finished_recving:
            for load in self._loading.pop(req_id, []):
                ok = not output.invalid_block_ids.intersection(load.block_ids)
                self.manager.complete_load(load.key, ok)

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        # Stores never need the blocks kept: the worker fences them before the next forward.
        self._requests.pop(request.request_id, None)
        self._plans.pop(request.request_id, None)
        self._asked.pop(request.request_id, None)
        self._retrying.pop(request.request_id, None)
        return False, None

    def take_events(self) -> list[Any]:
        return self.manager.take_events()

    def flush(self, timeout_s: float = 30.0) -> bool:
        """Wait until every planned store is in host memory, has gone on to the secondary
        tiers (write_back included) and every tier job has ended (an idle engine takes no steps
        to notice). False if `timeout_s` passed first."""
        deadline = time.monotonic() + timeout_s
        while True:
            self._collect_worker_reports()
            self.manager.write_back_all()
            self.manager.poll()
            if not self._storing and not self.manager.num_jobs_in_flight():
                return True
            if time.monotonic() > deadline:
                return False
            time.sleep(0.002)

    def shutdown(self) -> None:
        # Finish the cascade so that what this instance computed reaches the shared tiers.
        self.flush()
        self.manager.shutdown()
        close_session(self.session.session_id)
