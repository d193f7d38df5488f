"""Loads straight from the disk tier's mapped file: which chunks qualify (checked by this process
and in memory), that a pinned slot is never overwritten, and the start-up check of a restart."""

import mmap
import os

import pytest

from kvtier.engine.metrics import MetricsRegistry
from kvtier.offload.manager import Lookup
from kvtier.offload.tiers.base import LookupResult, TierContext
from kvtier.offload.tiers.disk import DiskTier, DiskTierOptions

from .offload_helpers import (
    CHUNK,
    NAMESPACE,
    chunk_bytes,
    drain,
    key,
    offload_config,
    store_from_device,
    tier_load,
    tier_store,
)

PAGE = 4096
STRIDE = 2 * PAGE
SECRET = b"s" * 32


@pytest.fixture
def make_tier(tmp_path):
    open_tiers = []

    def make(num_slots=4, secret=None, registry=None, **options):
        tier = DiskTier(DiskTierOptions(root_dir=str(tmp_path), max_bytes=PAGE + num_slots * STRIDE,
                                        **options),
                        TierContext("disk", NAMESPACE, registry, max_chunk_bytes=CHUNK,
                                    chunk_secret=secret))
        if tier._checker is not None:  # the start-up check, done before the test looks
            tier._checker.join(10)
            assert not tier._checker.is_alive()
        open_tiers.append(tier)
        return tier

    yield make
    for tier in open_tiers:
        tier.shutdown()


def _restart(tier, make_tier, **kwargs):
    tier.shutdown()
    tier.shutdown = lambda: True  # done: the fixture's own shutdown at the end is a no-op
    return make_tier(**kwargs)


def _mapped_bytes(chunk):
    return bytes(chunk.mapping.array[chunk.offset:chunk.offset + chunk.num_bytes])


def _present(tier, numbers):
    return [n for n in numbers if tier.lookup(key(n)) is LookupResult.FOUND]


def test_a_stored_chunk_maps_and_stays_until_released(make_tier):
    tier = make_tier(num_slots=4)
    if tier._mapping is None:
        pytest.skip("no file mapping with residency checks here")
    assert tier_store(tier, 1)
    assert tier.num_mappable([key(1)], CHUNK) == 1
    assert not tier.num_mappable([key(1)], CHUNK - 1)  # another group's size: never
    assert not tier.num_mappable([key(9)], CHUNK)
    assert tier_store(tier, 2)
    assert tier.num_mappable([key(n) for n in (1, 2, 9, 1)], CHUNK) == 2  # the leading run
    chunk = tier.pin_mapped([(key(1), CHUNK)])[0]
    assert _mapped_bytes(chunk) == chunk_bytes(1)
    for n in (3, 4, 5):  # 1 is the least recently used, but pinned: 2 makes room
        assert tier_store(tier, n)
    assert _present(tier, range(10)) == [1, 3, 4, 5]
    assert _mapped_bytes(chunk) == chunk_bytes(1)
    tier.release_mapped(chunk)
    assert not tier._readers_of
    assert tier_store(tier, 6)
    assert _present(tier, range(10)) == [3, 4, 5, 6]
    assert tier.pin_mapped([(key(1), CHUNK)])[0] is None


def test_a_restart_checks_resident_slots_without_reordering_them(make_tier):
    tier = make_tier(num_slots=2)
    if tier._mapping is None:
        pytest.skip("no file mapping with residency checks here")
    assert tier_store(tier, 1) and tier_store(tier, 2)
    again = _restart(tier, make_tier, num_slots=2)
    assert again.num_mappable([key(1)], CHUNK) and again.num_mappable([key(2)], CHUNK)
    assert tier_store(again, 3)  # 1, stored first, still goes first
    assert _present(again, range(5)) == [2, 3]


def test_a_slot_damaged_while_down_is_dropped_by_the_start_up_check(make_tier):
    tier = make_tier(num_slots=4)
    if tier._mapping is None:
        pytest.skip("no file mapping with residency checks here")
    assert tier_store(tier, 1) and tier_store(tier, 2)
    payload = PAGE + tier._index[key(2)] * STRIDE + PAGE
    tier.shutdown()
    tier.shutdown = lambda: True
    with open(tier.path, "r+b") as f:
        f.seek(payload + 5)
        f.write(b"\xff")
    registry = MetricsRegistry()
    again = make_tier(num_slots=4, registry=registry)
    assert again.num_mappable([key(1)], CHUNK)
    assert _present(again, [1, 2]) == [1]
    assert registry.snapshot()['kvtier:offload_tier_errors_total{tier="disk"}'] == 1


@pytest.mark.parametrize("how", ["off", "secret"])
def test_no_mapped_loads_when_off_or_under_a_chunk_secret(make_tier, how):
    tier = make_tier(**({"direct_loads": False} if how == "off" else {"secret": SECRET}))
    assert tier_store(tier, 1)
    assert tier._mapping is None and tier._checker is None
    assert not tier.num_mappable([key(1)], CHUNK) and tier.pin_mapped([(key(1), CHUNK)])[0] is None
    assert tier_load(tier, 1) == (True, chunk_bytes(1))


def test_a_chunk_out_of_memory_is_read_not_mapped(make_tier):
    tier = make_tier(num_slots=4)
    if tier._mapping is None:
        pytest.skip("no file mapping with residency checks here")
    assert tier_store(tier, 1)
    payload = PAGE + tier._index[key(1)] * STRIDE + PAGE
    os.fsync(tier._fd)
    tier._mapping._map.madvise(mmap.MADV_DONTNEED, payload, CHUNK)  # the store mapped them
    os.posix_fadvise(tier._fd, 0, 0, os.POSIX_FADV_DONTNEED)
    if tier._mapping.is_resident(payload, CHUNK):
        pytest.skip("the page cache keeps this file's pages (tmpfs)")
    assert not tier.num_mappable([key(1)], CHUNK)
    assert tier_load(tier, 1) == (True, chunk_bytes(1))  # the checked read brings it back
    assert tier.num_mappable([key(1)], CHUNK)


def test_a_chunk_in_the_disk_tiers_mapped_file_is_pinned_for_a_load(make_manager, tmp_path):
    manager = make_manager(offload_config(2, [{"type": "disk", "max_bytes": "1MiB",
                                               "root_dir": str(tmp_path)}]))
    if manager.tiers[0]._mapping is None:
        pytest.skip("no file mapping with residency checks here")
    for n in (1, 2, 3):  # 3 evicts 1 from the two host slots; 1 lives on in the disk tier
        store_from_device(manager, n)
        drain(manager)
    assert manager.lookup(key(1), CHUNK) is Lookup.MAPPED  # no promotion: loadable now
    assert manager.num_jobs_in_flight() == 0
    # The same answer for a run of chunks at once: 1, not 2 (in host memory) nor 9 (nowhere).
    assert [manager.num_mapped([key(n) for n in run], CHUNK)
            for run in ((1, 1), (1, 2), (2, 1), (9, 1))] == [2, 1, 0, 0]
    chunk, = manager.queries.pin_mapped([(key(1), CHUNK)])
    assert bytes(chunk.mapping.array[chunk.offset:chunk.offset + CHUNK]) == chunk_bytes(1)
    assert manager.tiers[0]._readers_of == {chunk.pin: 1}
    manager.queries.release_mapped(chunk, key(1))
    assert not manager.tiers[0]._readers_of
    assert manager.queries.pin_mapped([(key(9), CHUNK)]) == [None]
    stats = manager.metrics.snapshot()
    assert stats['kvtier:offload_tier_hits_total{tier="disk"}'] == 1
    assert stats.get('kvtier:offload_bytes_total{direction="disk_to_host"}', 0) == 0


def test_a_chunk_every_tier_maps_is_not_stored_into_host_memory_again(make_manager, tmp_path):
    # A memory tier that takes a chunk only at its first host hit: it lacks what never hit.
    memory = {"type": "memory", "admit_after_hits": 1}
    for others, stored_again in (([], False), ([memory], True)):
        disk = {"type": "disk", "max_bytes": "1MiB", "root_dir": str(tmp_path / str(len(others)))}
        manager = make_manager(offload_config(2, [disk, *others]))
        if manager.tiers[0]._mapping is None:
            pytest.skip("no file mapping with residency checks here")
        for n in (1, 2, 3):  # 1 leaves the two host slots; the disk tier keeps it
            store_from_device(manager, n)
            drain(manager)
        # Computed again on the device: a host copy is worth a slot only for the memory tier.
        assert (manager.prepare_store(key(1), CHUNK) is not None) is stored_again


def test_direct_loads_must_be_a_boolean(tmp_path):
    with pytest.raises(ValueError, match="disk.direct_loads must be true or false, got 'no'"):
        DiskTierOptions(root_dir=str(tmp_path), max_bytes="1MiB", direct_loads="no")
