"""ThreadedTier's queue: jobs waiting behind threads stuck in I/O (a hung mount) fail at their
deadline and give their host slots back; a job a thread has started keeps its slot until it ends."""

import time

import pytest

from kvtier.offload.tiers.base import TierContext, TransferJob

from .faulty_tiers import RELEASE_HANGING, HangingTier
from .offload_helpers import (
    CHUNK,
    FAULTY_TIERS,
    NAMESPACE,
    key,
    offload_config,
    store_from_device,
    wait_jobs,
)

HANGING = {"type": "HangingTier", "module_path": FAULTY_TIERS}
DEADLINE_S = 0.3


@pytest.fixture
def release_hanging():
    yield
    RELEASE_HANGING.set()  # wakes this test's stuck writers (set wakes every waiter now)
    RELEASE_HANGING.clear()


def wait_started(tier: HangingTier, count: int) -> None:
    for _ in range(count):
        assert tier.entered.acquire(timeout=10), "the write threads never took a job"


def test_queued_jobs_fail_at_their_deadline_and_started_ones_report_when_they_end(
        release_hanging):
    tier = HangingTier(None, TierContext("hanging", NAMESPACE))
    deadline = time.monotonic() + DEADLINE_S
    for job_id in range(4):  # two write threads: jobs 0 and 1 hang, 2 and 3 wait in the queue
        tier.submit_store(TransferJob(job_id, key(job_id), memoryview(bytes(CHUNK)), deadline))
    wait_started(tier, 2)
    assert tier.get_finished_jobs() == []  # before the deadline nothing fails
    time.sleep(max(0.0, deadline - time.monotonic()) + 0.01)
    assert [(r.job_id, r.ok, r.error) for r in tier.get_finished_jobs()] == \
        [(2, False, "deadline passed in queue"), (3, False, "deadline passed in queue")]
    RELEASE_HANGING.set()
    late = TransferJob(4, key(4), memoryview(bytes(CHUNK)), time.monotonic() + 10)
    tier.submit_store(late)  # queued behind 2 and 3: its report means the threads passed them
    assert wait_jobs(tier, [0, 1, 4]) == {0: False, 1: False, 4: False}
    assert tier.get_finished_jobs() == []  # 2 and 3 were reported once, by the deadline
    assert tier.shutdown()


def test_a_hung_tier_pins_only_the_slots_of_its_started_stores(make_manager, release_hanging):
    manager = make_manager(offload_config(4, [HANGING], tier_job_timeout_s=DEADLINE_S))
    for n in (1, 2, 3, 4):
        store_from_device(manager, n)
    wait_started(manager.tiers[0], 2)
    time.sleep(DEADLINE_S + 0.05)
    manager.poll()
    assert manager.num_jobs_in_flight() == 2  # the stores of 1 and 2, in the stuck threads
    assert [manager.host.entries[key(n)].num_readers for n in (1, 2, 3, 4)] == [1, 1, 0, 0]
    store_from_device(manager, 5)  # the slots of 3 and 4 are free for new chunks
    store_from_device(manager, 6)
    assert sorted(manager.host.entries) == sorted([key(1), key(2), key(5), key(6)])
    stats = manager.metrics.snapshot()
    assert stats['kvtier:offload_tier_errors_total{tier="HangingTier"}'] == 4
    assert 'kvtier:offload_skipped_stores_total{reason="no_host_slot"}' not in stats
