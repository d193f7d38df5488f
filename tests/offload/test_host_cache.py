import mmap
import sys

import pytest

from kvtier.offload.host_area import HostArea
from kvtier.offload.host_cache import ChunkState, HostCache
from kvtier.offload.policies import LRUPolicy


def _cache(num_slots=2, slot_bytes=8):
    area = HostArea(num_slots * slot_bytes, slot_bytes)
    return HostCache(area, LRUPolicy(area.num_slots))


def _store(cache, key):
    slot = cache.prepare_store(key, 8)
    cache.complete_store(key, ok=True)
    return slot


def test_host_area_slots_are_zero_copy_views():
    area = HostArea(100, 16)
    assert area.num_slots == 6 and area.capacity_bytes == 96
    area.slot_view(2)[:4] = b"abcd"
    assert bytes(area.buffer[32:36]) == b"abcd"
    with pytest.raises(ValueError, match=r"budget \(8 bytes: --kv-offload host=, or "
                                         r"cpu_bytes_to_use\) holds no chunk"):
        HostArea(8, 16)


def _resident_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


@pytest.mark.skipif(not sys.platform.startswith("linux") or not hasattr(mmap, "MAP_POPULATE"),
                    reason="MAP_POPULATE is Linux only")
def test_host_area_pages_are_resident_before_the_first_store():
    before = _resident_kib()
    area = HostArea(64 << 20, 1 << 20)
    assert _resident_kib() - before >= 60 << 10  # KiB: nearly all of the 64 MiB
    assert not area.buffer.any() and area.buffer.flags.writeable


def test_slots_handed_out_in_order_and_victims_in_lru_order():
    cache = _cache(num_slots=2)
    assert [_store(cache, "a"), _store(cache, "b")] == [0, 1]
    cache.prepare_load("a")  # a used after b
    cache.complete_load("a")
    assert _store(cache, "c") == 1  # b's slot
    assert cache.take_evicted() == ["b"]
    assert sorted(cache.entries) == ["a", "c"]


def test_a_request_pins_its_ready_chunks_in_one_call_and_sees_how_many_lead_ready():
    cache = _cache(num_slots=3)
    _store(cache, "a")
    _store(cache, "b")
    cache.prepare_store("c", 8)  # being written: not ready
    assert cache.count_ready(["a", "b", "c", "a"]) == 2
    assert cache.count_ready(["x", "a"]) == 0 and cache.count_ready([]) == 0
    assert cache.prepare_loads(["b", "c", "gone", "a"]) == [1, None, None, 0]
    cache.complete_store("c", ok=True)
    assert cache.prepare_store("d", 8) == 2  # a and b are pinned: c's slot
    cache.complete_store("d", ok=True)
    cache.complete_loads(["b", "a"])
    assert cache.prepare_store("e", 8) == 1  # b: pinned before a, so used less recently


def test_chunk_being_written_is_neither_readable_nor_evictable():
    cache = _cache(num_slots=1)
    assert cache.prepare_store("a", 8) == 0
    assert not cache.is_ready("a")
    assert cache.entries["a"].state is ChunkState.WRITING
    assert cache.prepare_store("b", 8) is None  # the only slot is under transfer
    assert cache.prepare_store("a", 8) is None  # already on its way
    cache.complete_store("a", ok=True)
    assert cache.is_ready("a")


def test_chunk_being_read_is_not_evicted_until_complete_load():
    cache = _cache(num_slots=2)
    _store(cache, "a")
    _store(cache, "b")
    cache.prepare_load("a")
    cache.prepare_load("b")
    assert cache.prepare_store("c", 8) is None
    cache.complete_load("b")
    assert cache.prepare_store("c", 8) == 1
    assert cache.take_evicted() == ["b"]
    cache.complete_load("a")
    assert cache.entries["a"].num_readers == 0


def test_failed_store_frees_the_slot():
    cache = _cache(num_slots=1)
    cache.prepare_store("a", 8)
    cache.complete_store("a", ok=False)
    assert cache.entries == {} and cache.fill_ratio == 0.0
    assert cache.prepare_store("b", 8) == 0


def test_eviction_takes_clean_chunks_before_dirty_ones_and_counts_dropped_dirty():
    cache = _cache(num_slots=3)
    for name in "abc":
        _store(cache, name)
    cache.mark_dirty("a")  # oldest, but dirty: b goes first
    cache.mark_dirty("c")
    assert _store(cache, "d") == 1
    assert cache.take_evicted() == ["b"] and cache.num_dropped_dirty == 0
    cache.mark_dirty("d")
    assert _store(cache, "e") == 0  # only dirty chunks left: the oldest is dropped
    assert cache.take_evicted() == ["a"] and cache.num_dropped_dirty == 1
    assert cache.num_dirty == 2
    assert cache.oldest_dirty() == "c"
    cache.mark_clean("c")
    assert cache.oldest_dirty() == "d"
    cache.mark_clean("d")
    assert cache.oldest_dirty() is None and cache.num_dirty == 0


def test_a_copy_without_use_leaves_the_eviction_order_alone():
    cache = _cache(num_slots=2)
    _store(cache, "a")
    _store(cache, "b")
    cache.prepare_load("a", count_use=False)  # a tier copying a out
    cache.complete_load("a")
    assert _store(cache, "c") == 0
    assert cache.take_evicted() == ["a"]
