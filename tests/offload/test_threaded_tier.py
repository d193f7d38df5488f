"""ThreadedTier's load queue: read threads drain it in batches, each job reported once."""

import threading
import time
from dataclasses import dataclass

from kvtier.offload.tiers.base import LookupResult, TierContext, TransferJob
from kvtier.offload.tiers.threaded import MAX_LOAD_BATCH, ThreadedTier

from .offload_helpers import NAMESPACE, key, wait_jobs

NUM_LOADS = 100


@dataclass(frozen=True)
class _Options:
    num_read_threads: int = 1
    num_write_threads: int = 1
    write_nice: int = 0


class _GatedTier(ThreadedTier):
    """Loads succeed once `gate` is set; `batches` records the size of each batch read."""

    def __init__(self) -> None:
        super().__init__(_Options(), TierContext("gated", NAMESPACE))
        self.gate = threading.Event()
        self.batches: list[int] = []

    def lookup(self, key, req_context=None) -> LookupResult:
        return LookupResult.FOUND

    def _store(self, job: TransferJob) -> None:
        raise AssertionError("no store in these tests")

    def _load(self, job: TransferJob) -> None:
        raise AssertionError("loads go through _load_batch")

    def _load_batch(self, jobs):
        assert self.gate.wait(10), "the test never opened the gate"
        self.batches.append(len(jobs))
        return [None] * len(jobs)


def _job(n: int, deadline_s: float = 10.0) -> TransferJob:
    return TransferJob(n, key(n), memoryview(bytearray(8)), time.monotonic() + deadline_s)


def test_loads_queued_behind_a_busy_read_thread_are_read_in_batches():
    tier = _GatedTier()
    try:
        for n in range(NUM_LOADS):
            tier.submit_load(_job(n))
        tier.gate.set()
        results = wait_jobs(tier, range(NUM_LOADS))
        # The first batch took what was queued when the thread woke; the rest waited for it.
        first, *rest = tier.batches
        left = NUM_LOADS - first
        assert rest == [MAX_LOAD_BATCH] * (left // MAX_LOAD_BATCH) + (
            [left % MAX_LOAD_BATCH] if left % MAX_LOAD_BATCH else [])
        assert results == {n: True for n in range(NUM_LOADS)}
        assert list(tier.get_finished_jobs()) == []  # each job reported once
    finally:
        tier.gate.set()
        tier.shutdown()


def test_a_load_past_its_deadline_in_the_queue_fails_unread():
    tier = _GatedTier()
    tier.gate.set()
    try:
        tier.submit_load(_job(0, deadline_s=-1.0))
        assert wait_jobs(tier, [0]) == {0: False}
        assert tier.batches == []
    finally:
        tier.shutdown()


def test_a_batch_that_raises_fails_its_jobs_and_the_queue_goes_on():
    tier = _GatedTier()
    calls = []

    def flaky(jobs):
        calls.append(len(jobs))
        if len(calls) == 1:
            raise OSError("device gone")
        return [None] * len(jobs)

    tier._load_batch = flaky
    try:
        tier.submit_load(_job(0))
        assert wait_jobs(tier, [0]) == {0: False}
        tier.submit_load(_job(1))
        assert wait_jobs(tier, [1]) == {1: True}
    finally:
        tier.shutdown()
