"""What the file-backed tiers share: I/O on two thread pools, outcomes on a queue.

Reads and writes run on separate pools so that a burst of stores never delays a promotion. The
write threads are niced: stores are background work and run in the CPU time the forward pass
leaves idle instead of taking turns with it; reads keep the engine's priority (a request waits
for them). A subclass implements `_store` and `_load`, which raise on any failure.
"""

from __future__ import annotations

import os
import queue
import sys
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from kvtier.common.options import is_positive_int, require
from kvtier.offload.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob


def check_thread_options(options: Any, where: str) -> None:
    """Validate the `num_read_threads`, `num_write_threads` and `write_nice` fields."""
    for name in ("num_read_threads", "num_write_threads"):
        require(is_positive_int(getattr(options, name)), f"{where}.{name}",
                "must be an integer >= 1", getattr(options, name))
    nice = options.write_nice
    require(isinstance(nice, int) and not isinstance(nice, bool) and 0 <= nice <= 19,
            f"{where}.write_nice", "must be an integer in 0..19", nice)


class ThreadedTier(SecondaryTier):
    def __init__(self, options: Any, context: TierContext) -> None:
        super().__init__(options, context)
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._readers = ThreadPoolExecutor(options.num_read_threads,
                                           f"kvtier-{context.name}-read")
        self._writers = ThreadPoolExecutor(options.num_write_threads,
                                           f"kvtier-{context.name}-write",
                                           initializer=_lower_priority,
                                           initargs=(options.write_nice,))

    def submit_store(self, job: TransferJob) -> None:
        self._writers.submit(self._run, job, self._store)

    def submit_load(self, job: TransferJob) -> None:
        self._readers.submit(self._run, job, self._load)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished = []
        while True:
            try:
                finished.append(self._finished.get_nowait())
            except queue.Empty:
                return finished

    def shutdown(self) -> None:
        self._readers.shutdown(wait=True, cancel_futures=True)
        self._writers.shutdown(wait=True, cancel_futures=True)

    @abstractmethod
    def _store(self, job: TransferJob) -> None: ...

    @abstractmethod
    def _load(self, job: TransferJob) -> None: ...

    def _run(self, job: TransferJob, action: Callable[[TransferJob], None]) -> None:
        """Run one job on a pool thread; every outcome becomes exactly one JobResult."""
        if time.monotonic() > job.deadline:
            self._finished.put(JobResult(job.job_id, ok=False, error="deadline passed in queue"))
            return
        start = time.monotonic()
        try:
            action(job)
        except Exception as exc:  # any tier failure is a failed job, never a lost one
            self._finished.put(JobResult(job.job_id, ok=False, error=f"{type(exc).__name__}: "
                                                                     f"{exc}"))
        else:
            ended = time.monotonic()
            self._finished.put(JobResult(job.job_id, ok=True, seconds=ended - start, ended=ended))


def _lower_priority(nice: int) -> None:
    """Add `nice` to the calling thread's niceness (Linux keeps one per thread)."""
    if nice == 0 or not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + nice)
    except OSError:
        pass  # the thread runs at the engine's priority: slower under load, still correct
