"""Bookkeeping for asynchronous KV loads (requests in WAITING_FOR_REMOTE_KVS).

A load starts when the scheduler allocates blocks for a request's external tokens, and ends
when the worker lists the request in `KVConnectorOutput.finished_recving`. In between, the
worker may write into those blocks at any time, so nothing may free or reuse them. A load that
landed is tracked on until its request starts: the blocks the request still needs stay
reserved for it until then.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.kv import RequestStatus

if TYPE_CHECKING:
    from kvtier.kv import KVCacheManager, Request


@dataclass
class _Load:
    deadline: float
    received: bool = False
    # Some loaded blocks were reported invalid; `num_computed_tokens` was cut back to them.
    failed: bool = False


class KVLoadTracker:
    """Which loads are in flight, until when, which have arrived, and which failed.

    Also holds the blocks of loads abandoned at their deadline: the request has moved on with
    fresh blocks, but the late worker may still write into the old ones, so they are freed only
    once the worker reports that load finished.
    """

    def __init__(self, timeout_s: float, clock: Callable[[], float]) -> None:
        self._timeout_s = timeout_s
        self._clock = clock
        self._loads: dict[str, _Load] = {}
        # req_id -> (blocks, deadline after which the engine stops waiting for them).
        self._orphaned_blocks: dict[str, tuple[Sequence, float]] = {}

    def start(self, req_id: str) -> None:
        self._loads[req_id] = _Load(deadline=self._clock() + self._timeout_s)

    def is_in_flight(self, req_id: str) -> bool:
        """Started and not yet reported finished by the worker."""
        load = self._loads.get(req_id)
        return load is not None and not load.received

    def __contains__(self, req_id: str) -> bool:
        """In flight, or landed and its request not yet started."""
        return req_id in self._loads

    def landed(self) -> list[str]:
        """Requests whose load landed and that have not started yet, in the order the loads
        started."""
        return [req_id for req_id, load in self._loads.items() if load.received]

    def mark_received(self, req_id: str) -> None:
        """The worker reported the load finished (ids of no load in flight are ignored)."""
        if self.is_in_flight(req_id):
            self._loads[req_id].received = True

    def mark_failed(self, req_id: str) -> None:
        self._loads[req_id].failed = True

    def is_failed(self, req_id: str) -> bool:
        """Some of the blocks the load filled were reported invalid."""
        return self._loads[req_id].failed

    def forget(self, req_id: str) -> None:
        """The request started, or finished (abort, error): its load no longer holds a
        reserve."""
        self._loads.pop(req_id, None)

    def overdue(self) -> list[str]:
        """Loads still in flight past their deadline."""
        now = self._clock()
        return [req_id for req_id, load in self._loads.items()
                if not load.received and now > load.deadline]

    def abandon(self, req_id: str, blocks: Sequence) -> None:
        """Give up waiting for a load; keep its blocks until the worker reports it finished."""
        del self._loads[req_id]
        self._orphaned_blocks[req_id] = (blocks, self._clock() + self._timeout_s)

    def take_orphaned_blocks(self, req_id: str) -> Sequence | None:
        entry = self._orphaned_blocks.pop(req_id, None)
        return None if entry is None else entry[0]

    def has_orphans_in_time(self) -> bool:
        """Abandoned loads whose late report is still worth waiting for. Past that, their
        blocks stay held (freeing them under a live write is worse) but nobody waits."""
        now = self._clock()
        return any(now <= deadline for _, deadline in self._orphaned_blocks.values())

    @property
    def num_in_flight(self) -> int:
        return sum(not load.received for load in self._loads.values())

    def num_blocks_to_finish(self, requests: Mapping[str, Request],
                             kv_cache_manager: KVCacheManager) -> int:
        """Blocks the requests with a load (in flight, or landed and not yet started) still
        need for the rest of their prefill: admissions leave them free, or a loaded request
        could not go on."""
        return sum(kv_cache_manager.num_blocks_to_finish_prefill(requests[req_id])
                   for req_id in self._loads)


def status_after_load(num_preemptions: int) -> RequestStatus:
    """A request leaving WAITING_FOR_REMOTE_KVS resumes as what it was before the load."""
    return RequestStatus.PREEMPTED if num_preemptions else RequestStatus.WAITING


def promote_after_load(request: Request, failed: bool, kv_cache_manager: KVCacheManager) -> None:
    """A request whose load landed becomes schedulable again: the blocks it computed (all of
    them, or up to the first invalid one if the load `failed`) join the prefix cache; with
    none valid, its blocks are freed and it starts afresh."""
    if failed and request.num_computed_tokens == 0:
        kv_cache_manager.free(request)
    else:
        kv_cache_manager.cache_blocks(request, request.num_computed_tokens)
    if not failed:
        # A whole-prompt hit still recomputes the last token to get its logits.
        request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
    request.status = status_after_load(request.num_preemptions)
