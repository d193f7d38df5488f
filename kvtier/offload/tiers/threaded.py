"""What the file-backed tiers share: I/O on two thread pools, outcomes on a queue.

Reads and writes run on separate pools so that a burst of stores never delays a promotion. The
write threads are niced: stores are background work and run in the CPU time the forward pass
leaves idle instead of taking turns with it; reads keep the engine's priority (a request waits
for them). A subclass implements `_store` and `_load`, which raise on any failure.

The pools' threads are daemon threads: a job stuck in I/O past its deadline is abandoned at
shutdown and never holds the process.
"""

from __future__ import annotations

import os
import queue
import sys
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

from kvtier.common.daemon_threads import DaemonThreadPool
from kvtier.common.options import is_positive_int, require
from kvtier.offload.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob

# Loads a read thread takes from its queue at once (`submit_loads`).
LOADS_PER_PIECE = 16
# Seconds shutdown waits for the pools' threads even when every job's deadline has passed.
_SHUTDOWN_GRACE_S = 0.5
# Most threads per pool: far past what a disk or a network link serves in parallel, and well
# under where the system refuses to start more ("can't start new thread").
MAX_THREADS = 64


def check_thread_options(options: Any, where: str) -> None:
    """Validate the `num_read_threads`, `num_write_threads` and `write_nice` fields."""
    for name in ("num_read_threads", "num_write_threads"):
        value = getattr(options, name)
        require(is_positive_int(value) and value <= MAX_THREADS, f"{where}.{name}",
                f"must be an integer in [1, {MAX_THREADS}]", value)
    nice = options.write_nice
    require(isinstance(nice, int) and not isinstance(nice, bool) and 0 <= nice <= 19,
            f"{where}.write_nice", "must be an integer in 0..19", nice)


class StoreSkipped(Exception):
    """Raised by `_store` for a store not attempted (the args[0] reason, e.g. "read_only")."""


class ThreadedTier(SecondaryTier):
    reports_job_ends: ClassVar[bool] = True

    def __init__(self, options: Any, context: TierContext) -> None:
        super().__init__(options, context)
        self._finished: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self._readers = DaemonThreadPool(options.num_read_threads, f"kvtier-{context.name}-read")
        self._writers = DaemonThreadPool(options.num_write_threads,
                                         f"kvtier-{context.name}-write",
                                         initializer=lower_priority,
                                         initargs=(options.write_nice,))
        # The latest deadline of any job submitted: shutdown waits for running jobs until then.
        self._last_deadline = 0.0

    def submit_store(self, job: TransferJob) -> None:
        self._last_deadline = max(self._last_deadline, job.deadline)
        self._writers.submit(self._run, job, self._store)

    def submit_load(self, job: TransferJob) -> None:
        self._last_deadline = max(self._last_deadline, job.deadline)
        self._readers.submit(self._run, job, self._load)

    def submit_loads(self, jobs: Sequence[TransferJob]) -> None:
        """The jobs in pieces of LOADS_PER_PIECE consecutive ones: the read threads take a queue
        item per piece instead of per chunk, and still share the pieces out as they free up."""
        if not jobs:
            return
        self._last_deadline = max(self._last_deadline, max(job.deadline for job in jobs))
        for start in range(0, len(jobs), LOADS_PER_PIECE):
            self._readers.submit(self._run_each, jobs[start:start + LOADS_PER_PIECE], self._load)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        finished = []
        while True:
            try:
                finished.append(self._finished.get_nowait())
            except queue.Empty:
                return finished

    def shutdown(self) -> bool:
        """Drop queued jobs and wait for running ones until the last job's deadline; True if
        every thread stopped (False: some are stuck in I/O and were abandoned)."""
        stopped = self._readers.shutdown(self._shutdown_wait_s(), cancel_pending=True)
        return self._writers.shutdown(self._shutdown_wait_s(), cancel_pending=True) and stopped

    def _shutdown_wait_s(self) -> float:
        # At least a moment, for idle threads to see the stop.
        return max(_SHUTDOWN_GRACE_S, self._last_deadline - time.monotonic())

    @abstractmethod
    def _store(self, job: TransferJob) -> None: ...

    @abstractmethod
    def _load(self, job: TransferJob) -> None: ...

    def _run(self, job: TransferJob, action: Callable[[TransferJob], None]) -> None:
        """Run one job on a pool thread; every outcome becomes exactly one JobResult."""
        if time.monotonic() > job.deadline:
            self._report(JobResult(job.job_id, ok=False, error="deadline passed in queue"))
            return
        start = time.monotonic()
        try:
            action(job)
        except StoreSkipped as skipped:
            self._report(JobResult(job.job_id, ok=False, skipped=skipped.args[0]))
        except Exception as exc:  # any tier failure is a failed job, never a lost one
            self._report(JobResult(job.job_id, ok=False, error=f"{type(exc).__name__}: {exc}"))
        else:
            ended = time.monotonic()
            self._report(JobResult(job.job_id, ok=True, seconds=ended - start, ended=ended))

    def _run_each(self, jobs: Sequence[TransferJob],
                  action: Callable[[TransferJob], None]) -> None:
        for job in jobs:
            self._run(job, action)

    def _report(self, result: JobResult) -> None:
        self._finished.put(result)
        if self.context.on_job_end is not None:
            self.context.on_job_end(result.job_id)


def lower_priority(nice: int) -> None:
    """Add `nice` to the calling thread's niceness (Linux keeps one per thread)."""
    if nice == 0 or not sys.platform.startswith("linux"):
        return
    try:
        os.setpriority(os.PRIO_PROCESS, 0, os.getpriority(os.PRIO_PROCESS, 0) + nice)
    except OSError:
        pass  # the thread runs at the engine's priority: slower under load, still correct
