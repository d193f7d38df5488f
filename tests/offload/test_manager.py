import threading
import time

import pytest

from kvtier.engine.metrics import MetricsRegistry
from kvtier.offload.events import TierMoveEvent
from kvtier.offload.manager import Lookup
from kvtier.offload.tier_queries import FAILED_LOAD_RETRY_S
from kvtier.offload.tiers.disk import FILE_HEADER_BYTES, slot_stride

from .offload_helpers import (
    CHUNK,
    FAULTY_TIERS,
    NAMESPACE,
    chunk_bytes,
    drain,
    key,
    offload_config,
    poll_until,
    read_host,
    store_from_device,
    stored_bytes,
)

MEMORY = {"type": "memory"}
RAISING = {"type": "RaisingTier", "module_path": FAULTY_TIERS}
STUCK = {"type": "StuckTier", "module_path": FAULTY_TIERS}
REFUSING = {"type": "RefusingTier", "module_path": FAULTY_TIERS}
HANGING = {"type": "HangingTier", "module_path": FAULTY_TIERS}


def test_host_hit_and_miss_without_tiers(make_manager):
    manager = make_manager(offload_config(2))
    store_from_device(manager, 1)
    assert manager.lookup(key(1), CHUNK) is Lookup.HIT
    assert manager.lookup(key(2), CHUNK) is Lookup.MISS
    assert read_host(manager, 1) == chunk_bytes(1)
    stats = manager.metrics.snapshot()
    assert stats['kvtier:offload_tier_queries_total{tier="host"}'] == 2
    assert stats['kvtier:offload_tier_hits_total{tier="host"}'] == 1


def test_store_cascades_to_every_tier_and_host_miss_promotes_with_retry(make_manager):
    manager = make_manager(offload_config(2, [MEMORY, MEMORY]))
    for n in (1, 2, 3):  # 3 evicts 1 from the two-slot host tier
        store_from_device(manager, n)
        manager.poll()
    assert manager.lookup(key(1), CHUNK) is Lookup.RETRY  # promotion from the first tier
    assert manager.lookup(key(1), CHUNK) is Lookup.RETRY  # still on its way: no 2nd promotion
    manager.poll()
    assert manager.lookup(key(1), CHUNK) is Lookup.HIT
    assert read_host(manager, 1) == chunk_bytes(1)
    events = manager.take_events()
    assert events[:3] == [TierMoveEvent(key(1), "device", "host"),
                          TierMoveEvent(key(1), "host", "memory", "local"),
                          TierMoveEvent(key(1), "host", "memory1", "local")]
    assert TierMoveEvent(key(1), "memory", "host", "local") in events
    assert TierMoveEvent(key(1), "host", None) in events  # the eviction
    assert TierMoveEvent(key(1), "host", "device") in events
    stats = manager.metrics.snapshot()
    assert stats['kvtier:offload_tier_hits_total{tier="memory"}'] == 1
    assert 'kvtier:offload_tier_queries_total{tier="memory1"}' not in stats


def test_chunks_under_cascade_are_not_evicted(make_manager):
    manager = make_manager(offload_config(1, [STUCK]))
    store_from_device(manager, 1)  # the stuck tier holds its store job: slot pinned
    manager.record_use(key(2))
    assert manager.prepare_store(key(2), CHUNK) is None
    manager.tiers[0].release(ok=True)
    manager.poll()
    assert manager.prepare_store(key(2), CHUNK) == 0


def test_store_without_a_free_host_slot_is_counted(make_manager):
    manager = make_manager(offload_config(1))
    manager.record_use(key(1))
    manager.record_use(key(2))
    assert manager.prepare_store(key(1), CHUNK) == 0  # the copy from the device is in flight
    assert manager.prepare_store(key(1), CHUNK) is None  # on its way already: no skip
    assert manager.prepare_store(key(2), CHUNK) is None
    skipped = 'kvtier:offload_skipped_stores_total{reason="no_host_slot"}'
    assert manager.metrics.snapshot()[skipped] == 1
    manager.complete_store(key(1), ok=True)
    assert manager.prepare_store(key(2), CHUNK) == 0
    assert manager.metrics.snapshot()[skipped] == 1


def test_store_threshold_waits_for_repeated_use(make_manager):
    manager = make_manager(offload_config(2, store_threshold=2))
    manager.record_use(key(1))
    assert manager.prepare_store(key(1), CHUNK) is None
    manager.record_use(key(1))
    assert manager.prepare_store(key(1), CHUNK) == 0


def test_raising_tier_is_a_counted_miss(make_manager):
    manager = make_manager(offload_config(1, [RAISING, MEMORY]))
    store_from_device(manager, 1)
    manager.poll()  # the memory tier's store is reported: 1's slot is unpinned
    store_from_device(manager, 2)  # evicts 1; the memory tier still has it
    manager.poll()
    assert poll_until(manager, 1) is Lookup.HIT  # served by the second tier
    assert read_host(manager, 1) == chunk_bytes(1)
    stats = manager.metrics.snapshot()
    # 2 failed stores + 1 failed lookup + 1 failed get_finished_jobs per poll (4 polls)
    assert stats['kvtier:offload_tier_errors_total{tier="RaisingTier"}'] == 7
    assert manager.num_jobs_in_flight() == 0


def test_late_promotion_is_a_miss_and_its_slot_stays_pinned(make_manager):
    now = [0.0]
    manager = make_manager(offload_config(2, [STUCK], tier_job_timeout_s=5.0),
                           clock=lambda: now[0])
    stuck = manager.tiers[0]
    assert manager.lookup(key(7), CHUNK) is Lookup.RETRY
    now[0] = 6.0
    manager.poll()
    assert manager.lookup(key(7), CHUNK) is Lookup.MISS
    assert manager.metrics.snapshot()['kvtier:offload_tier_errors_total{tier="StuckTier"}'] == 1
    assert key(7) in manager.host.entries  # the tier may still write into the slot
    manager.record_use(key(8))
    manager.record_use(key(9))
    assert manager.prepare_store(key(8), CHUNK) == 1
    assert manager.prepare_store(key(9), CHUNK) is None
    stuck.release(ok=True)  # reported late: discarded, the slot comes back
    manager.poll()
    assert key(7) not in manager.host.entries
    assert manager.lookup(key(7), CHUNK) is Lookup.MISS  # that tier failed it: not asked again


def test_a_failed_load_is_asked_again_after_the_retry_interval(make_manager):
    """A tier that failed a chunk (its store or peer was down) serves it again later, without a
    restart and without a new store of that chunk."""
    now = [0.0]
    manager = make_manager(offload_config(2, [STUCK]), clock=lambda: now[0])
    assert manager.lookup(key(3), CHUNK) is Lookup.RETRY
    manager.tiers[0].release(ok=False)
    manager.poll()
    now[0] = FAILED_LOAD_RETRY_S - 1
    assert manager.lookup(key(3), CHUNK) is Lookup.MISS
    now[0] = FAILED_LOAD_RETRY_S + 1
    assert manager.lookup(key(3), CHUNK) is Lookup.RETRY  # asked again: promoting
    manager.tiers[0].release(ok=True)
    manager.poll()
    assert manager.lookup(key(3), CHUNK) is Lookup.HIT


def test_failed_promotion_falls_back_to_miss(make_manager):
    manager = make_manager(offload_config(2, [STUCK]))
    assert manager.lookup(key(3), CHUNK) is Lookup.RETRY
    manager.tiers[0].release(ok=False)
    manager.poll()
    assert manager.lookup(key(3), CHUNK) is Lookup.MISS
    assert manager.host.entries == {}


def test_promotions_of_one_block_reach_the_tier_in_one_call_on_exit(make_manager):
    manager = make_manager(offload_config(8, [STUCK]))
    stuck = manager.tiers[0]
    assert manager.lookup(key(1), CHUNK) is Lookup.RETRY  # outside a block: at once
    assert stuck.load_calls == [1]
    with manager.promotions():
        assert [manager.lookup(key(n), CHUNK) for n in (2, 3, 4)] == [Lookup.RETRY] * 3
        assert len(stuck.held) == 1 and manager.is_promoting(key(3))
    assert stuck.load_calls == [1, 3]
    assert [job.key for job in stuck.held] == [key(n) for n in (1, 2, 3, 4)]
    stuck.release(ok=True)
    manager.poll()
    assert [manager.lookup(key(n), CHUNK) for n in (1, 2, 3, 4)] == [Lookup.HIT] * 4


def test_a_tier_refusing_a_block_of_promotions_fails_each_and_frees_its_slot(make_manager):
    manager = make_manager(offload_config(8, [REFUSING]))
    with manager.promotions():
        assert [manager.lookup(key(n), CHUNK) for n in (1, 2)] == [Lookup.RETRY] * 2
    assert manager.metrics.snapshot()['kvtier:offload_tier_errors_total{tier="RefusingTier"}'] == 1
    assert manager.num_jobs_in_flight() == 0 and manager.host.entries == {}
    assert not manager.is_promoting(key(1))
    assert manager.promotion_jobs([key(1), key(2)]) == []
    assert manager.lookup(key(1), CHUNK) is Lookup.MISS  # that tier failed it: not asked again


def test_groups_of_different_page_sizes_share_the_host_area(make_manager):
    # A hybrid model: an attention group (CHUNK bytes per chunk) and a Mamba group whose
    # per-block state is smaller. Both go through the same slots, tiers and promotion.
    from kvtier.offload.keys import make_chunk_key
    state_bytes = CHUNK // 4
    manager = make_manager(offload_config(2, [MEMORY]))
    state_key = make_chunk_key(NAMESPACE, 1, (5).to_bytes(32, "big"))
    manager.record_use(state_key)
    slot = manager.prepare_store(state_key, state_bytes)
    manager.area.slot_view(slot, state_bytes)[:] = chunk_bytes(5)[:state_bytes]
    manager.complete_store(state_key, ok=True)
    manager.poll()
    for n in (1, 2):  # push the state out of host memory
        store_from_device(manager, n)
        manager.poll()
    assert state_key not in manager.host.entries
    assert manager.lookup(state_key, state_bytes) is Lookup.RETRY
    manager.poll()
    assert manager.lookup(state_key, state_bytes) is Lookup.HIT
    [slot] = manager.prepare_loads([state_key])
    assert bytes(manager.area.slot_view(slot, state_bytes)) == chunk_bytes(5)[:state_bytes]
    assert len(manager.host.view(state_key)) == state_bytes


def test_found_below_while_every_host_slot_is_busy_is_asked_again(make_manager):
    manager = make_manager(offload_config(1, [MEMORY]))
    store_from_device(manager, 1)
    manager.poll()  # chunk 1 reaches the memory tier
    manager.record_use(key(2))
    slot = manager.prepare_store(key(2), CHUNK)  # evicts 1; the device is writing chunk 2
    # The only slot is busy, so chunk 1 cannot come up yet; a MISS would recompute it.
    assert manager.lookup(key(1), CHUNK) is Lookup.RETRY
    manager.area.slot_view(slot, CHUNK)[:] = chunk_bytes(2)
    manager.complete_store(key(2), ok=True)
    assert poll_until(manager, 1) is Lookup.HIT
    assert read_host(manager, 1) == chunk_bytes(1)


# Disk: with its loads straight from the mapped file off (a test of those is below).
@pytest.mark.parametrize("tier", [{"type": "fs"},
                                  {"type": "disk", "max_bytes": "1MiB", "direct_loads": False}],
                         ids=["fs", "disk"])
def test_manager_promotes_from_a_file_tier_after_host_eviction(make_manager, tmp_path, tier):
    name = tier["type"]
    manager = make_manager(offload_config(2, [{**tier, "root_dir": str(tmp_path)}]))
    for n in (1, 2, 3):  # 3 evicts 1 from the two host slots; 1 lives on in the file tier
        store_from_device(manager, n)
        drain(manager)
    assert manager.lookup(key(1), CHUNK) is Lookup.RETRY
    drain(manager)
    assert manager.lookup(key(1), CHUNK) is Lookup.HIT
    assert read_host(manager, 1) == chunk_bytes(1)
    stats = manager.metrics.snapshot()
    assert stats[f'kvtier:offload_tier_hits_total{{tier="{name}"}}'] == 1
    assert stats[f'kvtier:offload_bytes_total{{direction="host_to_{name}"}}'] == 3 * CHUNK
    assert stats[f'kvtier:offload_bytes_total{{direction="{name}_to_host"}}'] == CHUNK


def test_a_disk_tier_overwriting_a_chunk_is_an_eviction_event(make_manager, tmp_path):
    two_slots = FILE_HEADER_BYTES + 2 * slot_stride(CHUNK)
    manager = make_manager(offload_config(4, [{"type": "disk", "root_dir": str(tmp_path),
                                               "max_bytes": two_slots}]))
    for n in (1, 2, 3):  # the third store overwrites chunk 1's slot
        store_from_device(manager, n)
        drain(manager)
    events = manager.take_events()
    assert [e for e in events if e.destination is None] == [
        TierMoveEvent(key(1), "disk", None, "local")]
    assert manager.take_events() == []


# ---- per-tier policies ------------------------------------------------------------------------

def test_admit_after_hits_stores_a_chunk_on_its_nth_load(make_manager):
    manager = make_manager(offload_config(4, [
        {"type": "memory", "name": "all"},
        {"type": "memory", "name": "popular", "admit_after_hits": 2}]))
    store_from_device(manager, 1)
    store_from_device(manager, 2)
    manager.poll()
    assert stored_bytes(manager, "all") == 2 * CHUNK
    assert stored_bytes(manager, "popular") == 0
    read_host(manager, 1)
    manager.prepare_loads([key(1)])
    manager.complete_loads([key(1)], ok=False)  # a failed load is no hit
    manager.poll()
    assert stored_bytes(manager, "popular") == 0
    read_host(manager, 1)  # the second hit
    manager.poll()
    assert stored_bytes(manager, "popular") == CHUNK
    read_host(manager, 1)
    read_host(manager, 2)
    manager.poll()
    assert stored_bytes(manager, "popular") == CHUNK  # 1 is there already, 2 has one hit
    assert stored_bytes(manager, "all") == 2 * CHUNK


def test_a_tier_with_max_pending_stores_in_flight_drops_new_stores(make_manager):
    registry = MetricsRegistry()
    manager = make_manager(offload_config(5, [{**STUCK, "max_pending_stores": 2}, MEMORY]),
                           metrics_registry=registry)
    stuck = manager.tiers[0]
    for n in (1, 2, 3, 4, 5):
        store_from_device(manager, n)
    manager.poll()
    assert [job.key for job in stuck.held] == [key(1), key(2)]
    dropped = 'kvtier:offload_tier_dropped_stores_total{tier="StuckTier",reason="backpressure"}'
    assert manager.metrics.snapshot()[dropped] == 3
    assert registry.snapshot()[dropped] == 3
    assert stored_bytes(manager, "memory") == 5 * CHUNK  # the other tier is not held back
    # Only the two stores in flight pin their slots: a new chunk evicts one of the others.
    assert [manager.host.entries[key(n)].num_readers for n in (1, 2, 3, 4, 5)] == \
        [1, 1, 0, 0, 0]
    store_from_device(manager, 6)
    assert key(3) not in manager.host.entries
    stuck.release(ok=True)
    manager.poll()
    store_from_device(manager, 7)
    assert [job.key for job in stuck.held] == [key(7)]
    assert manager.metrics.snapshot()[dropped] == 4  # 6 arrived with two stores in flight


def test_flush_and_shutdown_with_a_hung_tier_end_by_the_job_deadline(make_manager):
    from .faulty_tiers import RELEASE_HANGING
    manager = make_manager(offload_config(4, [HANGING], tier_job_timeout_s=0.5))
    store_from_device(manager, 1)
    store_from_device(manager, 2)  # both cascades hang in the tier's write threads
    start = time.monotonic()
    try:
        assert manager.flush(timeout_s=30)  # every job ended or missed its deadline
        manager.shutdown()
        assert time.monotonic() - start < 0.5 + 5
        stats = manager.metrics.snapshot()
        assert stats['kvtier:offload_tier_errors_total{tier="HangingTier"}'] == 2
        hung = [t for t in threading.enumerate() if t.name.startswith("kvtier-HangingTier-write")
                and t.is_alive()]
        assert len(hung) == 2 and all(t.daemon for t in hung)  # abandoned, never joined
    finally:
        RELEASE_HANGING.set()  # wakes the writers of this test (set wakes every waiter now)
        RELEASE_HANGING.clear()


def test_events_keep_the_order_of_evictions_and_stores_within_a_step(make_manager):
    """A chunk evicted and stored again between two takes of the events: its removal comes
    before its new store, so a consumer ends with the host holding it."""
    manager = make_manager(offload_config(1))
    for n in (1, 2, 1):  # one slot: each store evicts the chunk before it
        store_from_device(manager, n)
    moves = [(e.key, e.source, e.destination) for e in manager.take_events()]
    assert moves == [(key(1), "device", "host"), (key(1), "host", None),
                     (key(2), "device", "host"), (key(2), "host", None),
                     (key(1), "device", "host")]


# ---- a chunk stored again from the device ------------------------------------------------------

def _count_writes(tier) -> list:
    """The keys of the stores `tier` is handed from now on, in order."""
    writes, submit_store = [], tier.submit_store
    tier.submit_store = lambda job: writes.append(job.key) or submit_store(job)
    return writes


def test_a_chunk_stored_again_is_not_written_to_a_tier_known_to_hold_it(make_manager):
    manager = make_manager(offload_config(1, [MEMORY]))
    writes = _count_writes(manager.tiers[0])
    for n in (1, 2, 1):  # one host slot: 2 evicts 1, which is recomputed and stored again
        store_from_device(manager, n)
        manager.poll()
    assert writes == [key(1), key(2)]
    assert stored_bytes(manager, "memory") == 2 * CHUNK
    assert [(e.key, e.destination) for e in manager.take_events() if e.source == "host"] == [
        (key(1), "memory"), (key(1), None), (key(2), "memory"), (key(2), None)]


def test_a_chunk_promoted_from_a_tier_is_not_written_back_to_it(make_manager):
    manager = make_manager(offload_config(1, [STUCK]))
    stuck = manager.tiers[0]
    assert manager.lookup(key(1), CHUNK) is Lookup.RETRY
    stuck.release(ok=True)
    manager.poll()
    assert manager.lookup(key(1), CHUNK) is Lookup.HIT
    store_from_device(manager, 2)  # evicts 1
    assert [job.key for job in stuck.held] == [key(2)]
    stuck.release(ok=True)
    manager.poll()
    store_from_device(manager, 1)  # evicts 2; recomputed, 1 is still on the tier
    assert stuck.held == []


def test_a_tier_that_lost_a_chunk_is_written_it_again(make_manager):
    """What the manager knows a tier holds is forgotten when the tier answers NOT_FOUND or
    fails the chunk's load: the request recomputes it, and its store repairs the tier."""
    manager = make_manager(offload_config(1, [MEMORY]))
    writes = _count_writes(manager.tiers[0])
    for n in (1, 2):
        store_from_device(manager, n)
        manager.poll()
    del manager.tiers[0]._chunks[key(1)]  # gone without a word (a shared store's eviction)
    assert manager.lookup(key(1), CHUNK) is Lookup.MISS
    store_from_device(manager, 1)
    manager.poll()
    assert writes == [key(1), key(2), key(1)]
    assert poll_until(manager, 2) is Lookup.HIT  # promoted back: 1 evicted
    assert poll_until(manager, 1) is Lookup.HIT
    stuck_manager = make_manager(offload_config(1, [STUCK]))
    stuck = stuck_manager.tiers[0]
    assert stuck_manager.lookup(key(3), CHUNK) is Lookup.RETRY  # found there
    stuck.release(ok=False)  # but damaged
    stuck_manager.poll()
    assert stuck_manager.lookup(key(3), CHUNK) is Lookup.MISS
    store_from_device(stuck_manager, 3)
    assert [job.key for job in stuck.held] == [key(3)]
