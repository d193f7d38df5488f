"""What the file-backed tiers share: I/O on two thread pools, outcomes on a queue.

Reads and writes run on separate pools so that a burst of stores never delays a promotion. The
write threads are niced: stores are background work and run in the CPU time the forward pass
leaves idle instead of taking turns with it; reads keep the engine's priority (a request waits
for them). A subclass implements `_store` and `_load`, which raise on any failure.

A job waits in its pool's queue until a thread claims it. One still unclaimed at its deadline is
reported failed by `get_finished_jobs` (on the engine's thread), so threads stuck in I/O (a hung
mount) never hold the host slots of the jobs queued behind them; a claimed job is reported only
by its thread, as the slot is its buffer until then. The pools' threads are daemon threads: a job
stuck in I/O past its deadline is abandoned at shutdown and never holds the process.
"""

from __future__ import annotations

import heapq
import os
import queue
import sys
import threading
import time
from abc import abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

from kvtier.common.daemon_threads import DaemonThreadPool
from kvtier.common.options import is_positive_int, require
from kvtier.offload.tiers.base import JobResult, SecondaryTier, TierContext, TransferJob

# Loads a read thread takes from its queue at once (`submit_loads`).
LOADS_PER_PIECE = 16
# The deadline heap is rebuilt from the unclaimed jobs once it is over twice their number plus
# this: each rebuild then removes at least this many entries of claimed jobs.
_MIN_HEAP_TO_COMPACT = 1024
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
        # Jobs submitted and not yet claimed by a thread nor failed by `_fail_expired`, by id,
        # and their (deadline, id) in a heap; the lock makes a claim and a failure exclusive.
        self._unclaimed: dict[int, TransferJob] = {}
        self._deadlines: list[tuple[float, int]] = []
        self._claim_lock = threading.Lock()

    def submit_store(self, job: TransferJob) -> None:
        self._submit(self._writers, [[job]], self._store)

    def submit_load(self, job: TransferJob) -> None:
        self._submit(self._readers, [[job]], self._load)

    def submit_loads(self, jobs: Sequence[TransferJob]) -> None:
        """The jobs in pieces of LOADS_PER_PIECE consecutive ones: the read threads take a queue
        item per piece instead of per chunk, and still share the pieces out as they free up."""
        self._submit(self._readers, [jobs[start:start + LOADS_PER_PIECE]
                                     for start in range(0, len(jobs), LOADS_PER_PIECE)],
                     self._load)

    def _submit(self, pool: DaemonThreadPool, pieces: Sequence[Sequence[TransferJob]],
                action: Callable[[TransferJob], None]) -> None:
        """Queue each piece of jobs for one thread of `pool`; raises (the pool is shut down)
        having queued none."""
        jobs = [job for piece in pieces for job in piece]
        if not jobs:
            return
        self._last_deadline = max(self._last_deadline, max(job.deadline for job in jobs))
        with self._claim_lock:  # before a thread can try to claim them
            for job in jobs:
                self._unclaimed[job.job_id] = job
                heapq.heappush(self._deadlines, (job.deadline, job.job_id))
        try:
            for piece in pieces:
                pool.submit(self._run_each, piece, action)
        except RuntimeError:  # a pool shut down refuses the first piece already
            with self._claim_lock:
                for job in jobs:
                    del self._unclaimed[job.job_id]
            raise

    def get_finished_jobs(self) -> Iterable[JobResult]:
        self._fail_expired()
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

    def _fail_expired(self) -> None:
        """Report the jobs still waiting for a thread at their deadline as failed."""
        now, expired = time.monotonic(), []
        with self._claim_lock:
            while self._deadlines and self._deadlines[0][0] < now:
                job = self._unclaimed.pop(heapq.heappop(self._deadlines)[1], None)
                if job is not None:  # None: a thread claimed it (it reports it)
                    expired.append(job)
            if len(self._deadlines) > 2 * len(self._unclaimed) + _MIN_HEAP_TO_COMPACT:
                # Mostly claimed jobs, which would wait for their deadlines to leave it.
                self._deadlines = [(job.deadline, job.job_id) for job in self._unclaimed.values()]
                heapq.heapify(self._deadlines)
        for job in expired:
            self._report(JobResult(job.job_id, ok=False, error="deadline passed in queue"))

    def _claim(self, job: TransferJob) -> bool:
        """Take `job` for this thread; False if it expired in the queue (reported already)."""
        with self._claim_lock:
            return self._unclaimed.pop(job.job_id, None) is not None

    def _run(self, job: TransferJob, action: Callable[[TransferJob], None]) -> None:
        """Run one job on a pool thread; every outcome becomes exactly one JobResult."""
        if not self._claim(job):
            return
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
