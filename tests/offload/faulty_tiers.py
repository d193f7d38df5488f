"""Out-of-tree tiers for the tests, loaded through `module_path` like a user's own tier."""

from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from kvtier.offload.tiers.base import (
    JobResult,
    LookupResult,
    SecondaryTier,
    TierContext,
    TransferJob,
)
from kvtier.offload.tiers.threaded import StoreSkipped, ThreadedTier


class RaisingTier(SecondaryTier):
    """Every call raises: a tier whose back end is gone."""

    def lookup(self, key, req_context: Any = None) -> LookupResult:
        raise ConnectionError("back end unreachable")

    def submit_store(self, job: TransferJob) -> None:
        raise ConnectionError("back end unreachable")

    def submit_load(self, job: TransferJob) -> None:
        raise ConnectionError("back end unreachable")

    def get_finished_jobs(self) -> Iterable[JobResult]:
        raise ConnectionError("back end unreachable")


class StuckTier(SecondaryTier):
    """Has every chunk, takes jobs and reports them only when `release()` is called."""

    def __init__(self, options: Any, context: TierContext) -> None:
        super().__init__(options, context)
        self.held: list[TransferJob] = []
        self._released: list[JobResult] = []
        self.load_calls: list[int] = []  # jobs per submit_loads call

    def lookup(self, key, req_context: Any = None) -> LookupResult:
        return LookupResult.FOUND

    def submit_store(self, job: TransferJob) -> None:
        self.held.append(job)

    def submit_load(self, job: TransferJob) -> None:
        self.held.append(job)

    def submit_loads(self, jobs) -> None:
        self.load_calls.append(len(jobs))
        super().submit_loads(jobs)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        released, self._released = self._released, []
        return released

    def release(self, ok: bool) -> None:
        self._released += [JobResult(job.job_id, ok=ok) for job in self.held]
        self.held = []


class RefusingTier(StuckTier):
    """Has every chunk; every load it is handed raises, as a tier whose queue is closed."""

    def submit_load(self, job: TransferJob) -> None:
        raise ConnectionError("queue closed")


@dataclass(frozen=True)
class _HangingOptions:
    num_read_threads: int = 1
    num_write_threads: int = 2
    write_nice: int = 0


class HangingTier(ThreadedTier):
    """Has nothing; every store blocks in its write thread until `RELEASE_HANGING` is set (in a
    process that never sets it: forever), like a write to a dead network file system. `entered`
    is released as each store starts."""

    def __init__(self, options: Any, context: TierContext) -> None:
        super().__init__(_HangingOptions(), context)
        self.entered = threading.Semaphore(0)

    def lookup(self, key, req_context: Any = None) -> LookupResult:
        return LookupResult.NOT_FOUND

    def _store(self, job: TransferJob) -> None:
        self.entered.release()
        RELEASE_HANGING.wait()
        raise ConnectionError("released")

    def _load(self, job: TransferJob) -> None:
        raise ConnectionError("nothing to load")


RELEASE_HANGING = threading.Event()


class SlowLoadTier(ThreadedTier):
    """Has every chunk; each load waits in its read thread until `RELEASE_SLOW_LOADS` is set (at
    most a minute), then fails, so the request recomputes."""

    def __init__(self, options: Any, context: TierContext) -> None:
        super().__init__(_HangingOptions(), context)

    def lookup(self, key, req_context: Any = None) -> LookupResult:
        return LookupResult.FOUND

    def _store(self, job: TransferJob) -> None:
        raise StoreSkipped("read_only")

    def _load(self, job: TransferJob) -> None:
        RELEASE_SLOW_LOADS.wait(60.0)
        raise ConnectionError("released")


RELEASE_SLOW_LOADS = threading.Event()
