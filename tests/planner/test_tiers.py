"""The offload tiers on simulated time, on the engine's HostCache and eviction policies."""

from kvtier.offload.config import OffloadConfig, parse_kv_offload
from kvtier.planner.tiers import SimulatedOffload

CHUNK = 4096  # the disk tier's slot: a page of header and one page of chunk


def _offload(flag_extra: dict, direct_loads: bool = True) -> SimulatedOffload:
    raw = {"cpu_bytes_to_use": 2 * CHUNK, "secondary_tiers": [
        {"type": "disk", "root_dir": "/nonexistent", "max_bytes": 3 * 2 * CHUNK + 4096,
         "direct_loads": direct_loads}]}
    return SimulatedOffload(OffloadConfig.from_extra_config({**raw, **flag_extra}), CHUNK)


def test_write_through_keeps_what_host_memory_evicts():
    offload = _offload({})
    assert (offload.host.cache.area.num_slots, offload.tiers[0].cache.area.num_slots) == (2, 3)
    for key in "abc":
        offload.store(key)
    # Host memory holds the last two (LRU); the disk got every store.
    assert [offload.find(k) for k in "abc"] == [1, 0, 0]
    offload.store("d")
    assert offload.find("a") is None  # the disk's LRU victim
    assert [offload.find(k) for k in "bcd"] == [1, 0, 0]


def test_pin_promotes_from_disk_and_protects_pinned_chunks():
    offload = _offload({}, direct_loads=False)
    for key in "abc":
        offload.store(key)
    pinned = offload.pin([("b", 0), ("a", 1)])
    assert pinned == [("b", 0), ("a", 1)]
    offload.release(pinned, loaded=True)
    # Promoting "a" evicted "c", the only host chunk not pinned.
    assert [offload.find(k) for k in "abc"] == [0, 0, 1]


def test_a_disk_tier_loading_from_its_file_promotes_nothing():
    offload = _offload({})
    for key in "abc":
        offload.store(key)
    pinned = offload.pin([("b", 0), ("a", 1)])
    assert pinned == [("b", 0), ("a", 1)]
    offload.release(pinned, loaded=True)
    # "a" went to the device from the disk tier's file: host memory still holds "b" and "c",
    # and the disk's LRU order saw the use ("b" is its oldest now).
    assert [offload.find(k) for k in "abc"] == [1, 0, 0]
    offload.store("d")
    assert offload.find("b") == 0 and offload.tiers[0].cache.is_ready("a")
    assert not offload.tiers[0].cache.is_ready("b")


def test_a_chunk_the_disk_tier_maps_is_not_stored_into_host_memory_again():
    offload = _offload({})
    for key in "abc":
        offload.store(key)  # "a" is on disk only
    offload.store("a")  # computed again (a device hit of a chunk loaded from the file)
    assert offload.find("a") == 1 and offload.num_stored == [3, 3]
    secret = _offload({"secret_file": "/nonexistent/secret"})
    assert not secret.tiers[0].maps  # every load checks a MAC: promoted, never mapped
    direct = _offload({}, direct_loads=False)
    for key in "abca":
        direct.store(key)  # promoted on a hit: the device's copy is stored as any other
    assert direct.find("a") == 0 and direct.num_stored[0] == 4


def test_write_back_stores_only_what_host_memory_evicts():
    offload = _offload({"write_policy": "write_back"})
    offload.store("a")
    offload.store("b")
    assert offload.find("a") == 0 and offload.tiers[0].cache.num_used_slots == 0
    offload.store("c")  # evicts "a" from host memory: written back
    assert offload.find("a") == 1 and offload.tiers[0].cache.num_used_slots == 1


def test_store_threshold_counts_uses():
    offload = _offload({"store_threshold": 2})
    offload.record_use("a")
    offload.store("a")
    assert offload.find("a") is None
    offload.record_use("a")
    offload.store("a")
    assert offload.find("a") == 0


def test_stores_count_only_chunks_written():
    offload = OffloadConfig.from_extra_config(parse_kv_offload("host=1MiB,disk=unused:4MiB"))
    tiers = SimulatedOffload(offload, 1024)
    tiers.store("a")
    tiers.store("b")
    assert tiers.num_stored == [2, 2]  # host memory, and on to the disk (write-through)
    tiers.store("a")  # already in both: nothing is written again
    assert tiers.num_stored == [2, 2]
