"""The write-back tiers: when dirty host chunks are written out, what backpressure does to
them, and what admission rules do (offload/write_back.py through the TieringManager)."""

from kvtier.engine.metrics import MetricsRegistry
from kvtier.offload.manager import Lookup

from .offload_helpers import (
    CHUNK,
    chunk_bytes,
    key,
    offload_config,
    poll_until,
    read_host,
    store_from_device,
    stored_bytes,
)

MEMORY = {"type": "memory"}


def test_write_back_writes_the_oldest_chunks_once_the_host_runs_short_of_clean_slots(
        make_manager):
    # 20 slots, one store per poll: the reserve is 2 slots, so at most 18 chunks stay unwritten.
    manager = make_manager(offload_config(20, [MEMORY], write_policy="write_back"))

    def written():
        return [n for n in range(1, 23) if manager.tiers[0].lookup(key(n)).name == "FOUND"]

    for n in range(1, 19):
        store_from_device(manager, n)
        manager.poll()
    assert written() == []
    assert manager.metrics.snapshot()["kvtier:offload_host_dirty_chunks"] == 18
    for n in range(19, 23):
        store_from_device(manager, n)
        manager.poll()  # starts a write-back
        manager.poll()  # collects it (a tier's job is reported at the next poll)
    # The host is full (20 slots, 22 chunks): the oldest were written before their eviction.
    assert written() == [1, 2, 3, 4]
    assert [e.key for e in manager.take_events() if e.source == "host" and
            e.destination is None] == [key(1), key(2)]
    assert poll_until(manager, 1) is Lookup.HIT  # promoted back from the tier
    assert read_host(manager, 1) == chunk_bytes(1)
    assert manager.metrics.snapshot()["kvtier:offload_writeback_dropped_total"] == 0
    manager.write_back.write_all()
    manager.poll()
    assert written() == list(range(1, 23))
    assert manager.metrics.snapshot()["kvtier:offload_host_dirty_chunks"] == 0


def test_write_back_reserve_grows_with_the_largest_burst_of_stores(make_manager):
    manager = make_manager(offload_config(20, [MEMORY], write_policy="write_back"))
    for n in range(1, 6):  # five stores in one step: keep ten slots clean or free
        store_from_device(manager, n)
    manager.poll()
    for n in range(6, 13):
        store_from_device(manager, n)
        manager.poll()
    assert [n for n in range(1, 13)
            if manager.tiers[0].lookup(key(n)).name == "FOUND"] == [1, 2]


def test_write_back_keeps_the_eviction_order(make_manager):
    # Writing a chunk out is not a use: under ARC it stays in T1 (seen once).
    manager = make_manager(offload_config(2, [MEMORY], write_policy="write_back",
                                          eviction_policy="arc"))
    store_from_device(manager, 1)
    store_from_device(manager, 2)
    manager.poll()  # the reserve (1 slot) forces chunk 1 out to the tier
    assert manager.tiers[0].lookup(key(1)).name == "FOUND"
    assert list(manager.host.policy.t1) == [key(1), key(2)] and not manager.host.policy.t2


def test_write_back_and_write_through_tiers_in_one_config(make_manager):
    # Connector-level write_back: "far" inherits it, "near" overrides it. 40 slots: the
    # write-back reserve (4 evictable slots) stays met.
    manager = make_manager(offload_config(40, [
        {"type": "memory", "name": "near", "write_policy": "write_through"},
        {"type": "memory", "name": "far"}], write_policy="write_back"))
    for n in (1, 2):
        store_from_device(manager, n)
    manager.poll()
    assert stored_bytes(manager, "near") == 2 * CHUNK  # at once
    assert stored_bytes(manager, "far") == 0
    assert manager.host.num_dirty == 2  # still owed to "far"
    manager.write_back.write_all()
    manager.poll()
    assert stored_bytes(manager, "near") == 2 * CHUNK  # not written twice
    assert stored_bytes(manager, "far") == 2 * CHUNK
    assert manager.host.num_dirty == 0
    assert [e.destination for e in manager.take_events() if e.source == "host"] == \
        ["near", "near", "far", "far"]


def test_write_back_tier_is_written_when_host_memory_needs_room(make_manager):
    manager = make_manager(offload_config(4, [
        {"type": "memory", "name": "near"},
        {"type": "memory", "name": "far", "write_policy": "write_back"}]))
    for n in (1, 2):
        store_from_device(manager, n)
        manager.poll()  # one slot taken per poll: the reserve is 2 free or clean slots
    assert stored_bytes(manager, "far") == 0
    store_from_device(manager, 3)
    manager.poll()  # 1 free slot left: the oldest dirty chunk goes to "far"
    manager.poll()
    assert stored_bytes(manager, "near") == 3 * CHUNK
    assert stored_bytes(manager, "far") == CHUNK
    assert [e.key for e in manager.take_events() if e.destination == "far"] == [key(1)]
    assert manager.host.num_dirty == 2


def test_write_back_waits_for_a_tier_at_max_pending_stores_instead_of_dropping(
        make_manager, tmp_path):
    """A chunk dropped for backpressure on its way to a write-back tier would be clean and on
    no tier: it stays dirty until the tier takes it, and flush waits for all of them."""
    fs = {"type": "fs", "root_dir": str(tmp_path), "write_policy": "write_back",
          "max_pending_stores": 2}
    manager = make_manager(offload_config(20, [fs]), metrics_registry=MetricsRegistry())
    for n in range(1, 11):
        store_from_device(manager, n)
    manager.poll()
    assert manager.flush(30.0)
    assert manager.host.num_dirty == 0
    assert manager.metrics.snapshot().get(
        'kvtier:offload_dropped_stores_total{tier="fs",reason="backpressure"}', 0) == 0
    restarted = make_manager(offload_config(20, [fs]))
    assert [poll_until(restarted, n) for n in range(1, 11)] == [Lookup.HIT] * 10


def test_admit_after_hits_on_a_write_back_tier_is_checked_at_write_back(make_manager):
    manager = make_manager(offload_config(4, [
        {"type": "memory", "write_policy": "write_back", "admit_after_hits": 1}]))
    for n in (1, 2, 3):
        store_from_device(manager, n)
    read_host(manager, 2)
    manager.write_back.write_all()
    manager.poll()
    assert stored_bytes(manager, "memory") == CHUNK  # only 2 was hit
    assert manager.host.num_dirty == 0  # 1 and 3 are not owed to any tier


def test_a_chunk_stored_again_is_not_owed_to_a_write_back_tier_that_holds_it(make_manager):
    manager = make_manager(offload_config(1, [MEMORY], write_policy="write_back"))
    for n in (1, 2, 1):  # one host slot: 2 evicts 1 once written, then 1 is recomputed
        store_from_device(manager, n)
        manager.poll()  # the reserve (1 slot) writes the chunk out
        manager.poll()
    assert manager.host.num_dirty == 0
    assert stored_bytes(manager, "memory") == 2 * CHUNK
