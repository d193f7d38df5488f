"""What the scheduler does when KV is not written intact: load failures, failed steps.

A step that raised (the forward pass, a synchronous load, or anything after the blocks were
handed out) leaves the blocks it was to fill unwritten, though their hashes are already in the
prefix cache: they are dropped from it, so no later request reads them.

Two ways a load fails: the worker reports some loaded blocks invalid
(`KVConnectorOutput.invalid_block_ids`), or an asynchronous load misses its deadline. Bad
blocks are always dropped from the prefix cache so no other request can hit them; then
`kv_load_failure_policy` decides: `recompute` cuts the request's computed tokens back to the
first bad block and computes from there, `fail` finishes it with FINISHED_ERROR.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from kvtier.kv import Request, RequestStatus
from kvtier.sched.kv_loads import KVLoadTracker, status_after_load
from kvtier.sched.output import EngineCoreOutput, SchedulerOutput

if TYPE_CHECKING:
    from kvtier.kv import KVCacheManager


class SchedulerState(Protocol):
    """What load-failure handling reads and changes of the scheduler it serves."""

    requests: dict[str, Request]
    kv_cache_manager: KVCacheManager
    loads: KVLoadTracker
    no_external_load: set[str]
    resync_req_ids: set[str]

    def remove_from_queues(self, requests: list[Request]) -> None: ...

    def finish_request(self, request: Request,
                       status: RequestStatus) -> dict[str, Any] | None: ...


class TransferFailures:
    """The scheduler's load-failure handling, kept apart from the step pipeline it serves."""

    def __init__(self, scheduler: SchedulerState, policy: str) -> None:
        self._scheduler = scheduler
        self._policy = policy
        kv_cache_config = scheduler.kv_cache_manager.kv_cache_config
        self._group_block_sizes = [group.kv_cache_spec.block_size
                                   for group in kv_cache_config.kv_cache_groups]
        self.num_load_failures = 0
        self.num_load_timeouts = 0

    def reset_counts(self) -> None:
        self.num_load_failures = 0
        self.num_load_timeouts = 0

    def uncache_failed_step(self, scheduler_output: SchedulerOutput) -> None:
        """The step of `scheduler_output` raised: its blocks may hold no valid KV, from the
        tokens it computed and from the tokens a connector was to load during it (their
        blocks were cached when they were allocated)."""
        sched = self._scheduler
        num_loaded = scheduler_output.num_external_computed_tokens
        for req_id, num_new in scheduler_output.num_scheduled_tokens.items():
            request = sched.requests.get(req_id)
            if request is not None:
                # schedule() already counted the step's tokens as computed.
                first = request.num_computed_tokens - num_new - num_loaded.get(req_id, 0)
                sched.kv_cache_manager.evict_blocks(self._block_ids_from(request, first))

    def abandon_overdue_loads(self) -> None:
        """Loads past their deadline count as failed: the request recomputes with fresh
        blocks; the old ones stay held until the late worker reports the load finished."""
        sched = self._scheduler
        for req_id in sched.loads.overdue():
            request = sched.requests[req_id]
            sched.loads.abandon(req_id, sched.kv_cache_manager.pop_blocks_for_free(request))
            request.num_computed_tokens = 0
            request.status = status_after_load(request.num_preemptions)
            sched.no_external_load.add(req_id)
            self.num_load_timeouts += 1

    def handle_invalid_blocks(self, invalid_block_ids: set[int],
                              outputs: list[EngineCoreOutput]) -> set[str]:
        """Apply the policy to every live request holding a bad block within its computed
        tokens. Appends error outputs (policy `fail`) to `outputs`; returns the ids whose
        tokens sampled this step came from bad KV and must be dropped."""
        sched = self._scheduler
        sched.kv_cache_manager.evict_blocks(invalid_block_ids)
        discarded: set[str] = set()
        for request in list(sched.requests.values()):
            if request.is_finished():
                continue
            first_bad = self._first_bad_position(request, invalid_block_ids)
            if first_bad is None or first_bad >= request.num_computed_tokens:
                continue
            self.num_load_failures += 1
            # KV computed after a bad block attended to it: that is bad too.
            sched.kv_cache_manager.evict_blocks(self._block_ids_from(request, first_bad))
            if request.status == RequestStatus.RUNNING:
                discarded.add(request.request_id)
            if self._policy == "fail":
                outputs.append(self._fail(request, first_bad))
            else:
                self._recompute_from(request, first_bad)
        return discarded

    def _first_bad_position(self, request: Request, invalid_block_ids: set[int]) -> int | None:
        """Token position where the request's first invalid block starts, over all groups."""
        block_ids = self._scheduler.kv_cache_manager.get_block_ids(request.request_id)
        positions = [index * block_size
                     for ids, block_size in zip(block_ids, self._group_block_sizes)
                     for index, block_id in enumerate(ids) if block_id in invalid_block_ids]
        return min(positions, default=None)

    def _block_ids_from(self, request: Request, position: int) -> list[int]:
        """The request's blocks, in every group, holding tokens at or after `position`."""
        block_ids = self._scheduler.kv_cache_manager.get_block_ids(request.request_id)
        return [block_id
                for ids, block_size in zip(block_ids, self._group_block_sizes)
                for block_id in ids[position // block_size:]]

    def _recompute_from(self, request: Request, first_bad: int) -> None:
        sched = self._scheduler
        resume = sched.kv_cache_manager.resumable_tokens(request, first_bad)
        request.num_computed_tokens = resume
        if request.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
            sched.loads.mark_failed(request.request_id)
        elif request.status == RequestStatus.RUNNING:
            if resume == 0:
                # Starting over: in fresh blocks, since a state or window group's table has
                # holes (null blocks) where the recompute writes.
                sched.kv_cache_manager.free(request)
            # The runner's copy of this request ran ahead on bad KV: it rebuilds it.
            sched.resync_req_ids.add(request.request_id)
        elif resume == 0:
            # Promoted but not yet admitted: with nothing valid left it starts from a fresh
            # prefix lookup, which needs it to hold no blocks.
            sched.kv_cache_manager.free(request)

    def _fail(self, request: Request, first_bad: int) -> EngineCoreOutput:
        sched = self._scheduler
        request.error = (f"KV load failed for request {request.request_id!r}: the block at "
                         f"token {first_bad} arrived invalid (kv_load_failure_policy='fail'; "
                         "use 'recompute' to compute it locally instead)")
        sched.remove_from_queues([request])
        kv_transfer_params = sched.finish_request(request, RequestStatus.FINISHED_ERROR)
        return EngineCoreOutput(req_id=request.request_id, new_token_ids=[],
                                finish_reason="error",
                                num_cached_tokens=request.num_cached_tokens or 0,
                                kv_transfer_params=kv_transfer_params, error=request.error)
