"""The promotion watch: an idle engine sleeps until a waiting request's promotions are in."""

import threading
import time

import pytest

from kvtier.offload.manager import Lookup
from kvtier.offload.promotion_watch import PromotionWatch

from .offload_helpers import CHUNK, drain, key, offload_config, store_from_device
from .test_manager import STUCK

LONG_S = 10.0  # a wait that ran this long was never woken


def timed_wait(watch: PromotionWatch, timeout_s: float = LONG_S, poll_s: float = 0.001) -> float:
    start = time.monotonic()
    watch.wait(timeout_s, poll_s)
    return time.monotonic() - start


def end_later(watch: PromotionWatch, job_ids, delay_s: float = 0.05) -> threading.Thread:
    def run():
        for job_id in job_ids:
            time.sleep(delay_s)
            watch.ended(job_id)
    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_wait_ends_when_the_last_promotion_a_request_needs_ends():
    watch = PromotionWatch()
    for job_id in (1, 2, 3):
        watch.started(job_id)
    watch.expect([[1, 2]], poll=False)
    thread = end_later(watch, [3, 1, 2], delay_s=0.05)  # 3 is nobody's: it wakes no one
    waited = timed_wait(watch)
    thread.join()
    # Woken by job 2's end (~0.15 s after the thread started, a little before the wait did),
    # not by job 1's (~0.10 s).
    assert 0.125 <= waited < LONG_S / 2


def test_one_request_met_wakes_the_wait_while_another_still_waits():
    watch = PromotionWatch()
    for job_id in (1, 2):
        watch.started(job_id)
    watch.expect([[1], [2]], poll=False)
    thread = end_later(watch, [2])
    assert timed_wait(watch) < LONG_S / 2
    thread.join()


def test_needs_met_before_the_wait_return_at_once():
    watch = PromotionWatch()
    watch.started(7)
    watch.ended(7)  # ended between the lookup and the end of the step
    watch.expect([[7]], poll=False)
    assert timed_wait(watch) < LONG_S / 2
    watch.started(8)
    watch.expect([[8]], poll=False)
    watch.ended(8)  # ended after expect, before wait
    assert timed_wait(watch) < LONG_S / 2


def test_unmet_needs_wait_until_the_timeout():
    watch = PromotionWatch()
    watch.started(1)
    watch.expect([[1]], poll=False)
    assert timed_wait(watch, timeout_s=0.05) >= 0.05


@pytest.mark.parametrize("needs", [[], [[1]]], ids=["nobody waits", "another wait too"])
def test_polls_when_it_cannot_tell(needs):
    watch = PromotionWatch()
    watch.started(1)
    watch.expect(needs, poll=bool(needs))
    assert timed_wait(watch, poll_s=0.001) < LONG_S / 2


def test_interrupt_ends_the_wait_under_way_and_the_next_one():
    watch = PromotionWatch()
    watch.started(1)
    watch.expect([[1]], poll=False)
    timer = threading.Timer(0.05, watch.interrupt)
    timer.start()
    assert timed_wait(watch) < LONG_S / 2
    timer.join()
    watch.interrupt()  # before the wait: a command queued while the engine was stepping
    assert timed_wait(watch) < LONG_S / 2
    assert timed_wait(watch, timeout_s=0.05) >= 0.05  # consumed: the next wait is a wait


# Disk: with its loads straight from the mapped file off (they need no promotion).
@pytest.mark.parametrize("tier", [{"type": "fs"},
                                  {"type": "disk", "max_bytes": "1MiB", "direct_loads": False}],
                         ids=["fs", "disk"])
def test_a_file_tier_tells_the_watch_as_each_promotion_ends(make_manager, tmp_path, tier):
    manager = make_manager(offload_config(2, [{**tier, "root_dir": str(tmp_path)}]))
    for n in (1, 2, 3):  # 3 evicts 1 from the two host slots; 1 lives on in the file tier
        store_from_device(manager, n)
        drain(manager)
    assert manager.lookup(key(1), CHUNK) is Lookup.RETRY
    jobs = manager.promotion_jobs([key(1), key(2)])  # key 2 is in host memory: no job
    assert jobs is not None and len(jobs) == 1
    manager.watch.expect([jobs], poll=False)
    assert timed_wait(manager.watch) < LONG_S / 2  # woken by the tier's read thread
    manager.poll()
    assert manager.lookup(key(1), CHUNK) is Lookup.HIT


def test_promotions_from_a_tier_that_does_not_report_ends_are_polled(make_manager):
    manager = make_manager(offload_config(2, [STUCK]))
    assert manager.lookup(key(5), CHUNK) is Lookup.RETRY
    assert manager.promotion_jobs([key(5)]) is None  # the connector tells the watch to poll
    manager.tiers[0].release(ok=True)
    manager.poll()  # collecting the result ends the job in the watch too
    assert manager.promotion_jobs([key(5)]) == []
    manager.watch.expect([[0]], poll=False)  # job 0 ended: nothing left to wait for
    assert timed_wait(manager.watch) < LONG_S / 2
    assert manager.lookup(key(5), CHUNK) is Lookup.HIT
