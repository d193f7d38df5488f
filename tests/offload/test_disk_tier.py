import json
import os
import random
import subprocess
import sys
import textwrap

import pytest

from kvtier.common.options import parse_options
from kvtier.offload.events import TierMoveEvent
from kvtier.offload.manager import Lookup
from kvtier.offload.tiers.base import LookupResult, TierContext
from kvtier.offload.tiers.disk import (
    DiskTier,
    DiskTierInUseError,
    DiskTierOptions,
    DiskTierSetupError,
)

from .offload_helpers import (
    CHUNK,
    NAMESPACE,
    chunk_bytes,
    drain,
    key,
    offload_config,
    poll_until,
    store_from_device,
    tier_job,
    tier_load,
    tier_store,
    wait_jobs,
)

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PAGE = 4096
STRIDE = PAGE + PAGE  # slot header page + CHUNK (64 bytes) rounded up to a page


def _budget(num_slots: int) -> int:
    return PAGE + num_slots * STRIDE


@pytest.fixture
def make_tier():
    """make(root, ...) opens a tier with `num_slots` slots, once its start-up check is done;
    every tier left open is shut down after the test (`_close` shuts one down earlier, to
    restart on its file)."""
    open_tiers = []

    def make(root, num_slots=8, namespace=NAMESPACE, max_chunk_bytes=CHUNK, **options):
        tier = DiskTier(DiskTierOptions(root_dir=str(root), max_bytes=_budget(num_slots),
                                        **options),
                        TierContext("disk", namespace, max_chunk_bytes=max_chunk_bytes))
        tier.open_tiers = open_tiers
        open_tiers.append(tier)
        if tier._checker is not None:
            # The start-up check reads the restarted chunks, each pinned while read; a store
            # meanwhile passes over a pinned least recently used chunk and overwrites the next.
            tier._checker.join(10)
            assert not tier._checker.is_alive(), "the start-up check hangs"
        return tier

    yield make
    for tier in open_tiers:
        tier.shutdown()


def _close(tier):
    tier.open_tiers.remove(tier)
    tier.shutdown()


def _present(tier, numbers):
    """Those of `numbers` the tier holds, asked without counting a use (a lookup counts)."""
    return [n for n in numbers if key(n) in tier._index]


def test_store_then_load_round_trip_in_a_preallocated_file(make_tier, tmp_path):
    tier = make_tier(tmp_path, num_slots=8)
    assert tier.path == os.path.join(str(tmp_path), NAMESPACE.hex() + ".kvslots")
    assert (tier.stride, tier.num_slots) == (STRIDE, 8)
    assert os.path.getsize(tier.path) == _budget(8)
    assert os.stat(tier.path).st_blocks * 512 >= _budget(8)  # space reserved up front
    assert tier.lookup(key(1)) is LookupResult.NOT_FOUND
    assert tier_store(tier, 1) and tier_store(tier, 2)
    assert _present(tier, [1, 2, 3]) == [1, 2]
    assert tier_load(tier, 1) == (True, chunk_bytes(1))
    assert tier_load(tier, 2) == (True, chunk_bytes(2))
    assert tier_load(tier, 3)[0] is False  # never stored: a failed job, not an exception


def test_loads_submitted_together_each_report_their_own_bytes(make_tier, tmp_path):
    """`submit_loads` hands the read threads pieces of several jobs; every job is still
    reported alone, a missing chunk failing only its own job."""
    from kvtier.offload.tiers.threaded import LOADS_PER_PIECE
    tier = make_tier(tmp_path, num_slots=64)
    numbers = list(range(2 * LOADS_PER_PIECE + 5))
    for n in numbers[:-1]:  # the last one is never stored
        assert tier_store(tier, n)
    jobs = [tier_job(n, memoryview(bytearray(CHUNK))) for n in numbers]
    tier.submit_loads(jobs)
    results = wait_jobs(tier, [job.job_id for job in jobs])
    assert [results[job.job_id] for job in jobs] == [True] * (len(numbers) - 1) + [False]
    assert [bytes(job.buffer) for job in jobs[:-1]] == [chunk_bytes(n) for n in numbers[:-1]]


def test_storing_a_present_chunk_again_takes_no_slot(make_tier, tmp_path):
    tier = make_tier(tmp_path, num_slots=2)
    for n in (1, 1, 1, 2):
        assert tier_store(tier, n)
    assert _present(tier, [1, 2]) == [1, 2]


def test_full_file_overwrites_the_least_recently_used_chunk(make_tier, tmp_path):
    tier = make_tier(tmp_path, num_slots=3)
    for n in (0, 1, 2):
        assert tier_store(tier, n)
    assert tier_load(tier, 0)[0]  # 0 becomes the most recently used
    assert tier_store(tier, 3)  # overwrites 1
    assert _present(tier, range(4)) == [0, 2, 3]
    assert tier_store(tier, 4)  # overwrites 2
    assert _present(tier, range(5)) == [0, 3, 4]
    # The overwritten chunks are reported once each, for KV events.
    assert tier.take_evicted() == [key(1), key(2)] and tier.take_evicted() == []
    for n in (0, 3, 4):
        assert tier_load(tier, n) == (True, chunk_bytes(n))


def test_a_chunk_found_by_a_lookup_is_overwritten_last(make_tier, tmp_path):
    # Its load is queued next; the stores of the same step must not overwrite it first.
    tier = make_tier(tmp_path, num_slots=3)
    for n in (0, 1, 2):
        assert tier_store(tier, n)
    assert tier.lookup(key(0)) is LookupResult.FOUND
    assert tier.lookup(key(9)) is LookupResult.NOT_FOUND
    assert tier_store(tier, 3) and tier_store(tier, 4)  # overwrite 1 and 2, not 0
    assert tier.take_evicted() == [key(1), key(2)]
    assert tier_load(tier, 0) == (True, chunk_bytes(0))


def test_a_slot_being_read_is_not_overwritten(make_tier, tmp_path):
    tier = make_tier(tmp_path, num_slots=2)
    assert tier_store(tier, 0) and tier_store(tier, 1)
    tier._readers_of[tier._index[key(0)]] = 1  # a load of 0, the oldest, is in progress
    assert tier_store(tier, 2)
    assert _present(tier, range(3)) == [0, 2]
    tier._readers_of[tier._index[key(2)]] = 1
    assert tier_store(tier, 3) is False  # every slot is being read: the store fails, nothing lost
    assert _present(tier, range(4)) == [0, 2]


def test_restart_finds_every_chunk_and_the_store_order(make_tier, tmp_path):
    tier = make_tier(tmp_path, num_slots=3)
    for n in (5, 6, 7):
        assert tier_store(tier, n)
    _close(tier)
    again = make_tier(tmp_path, num_slots=3)
    assert _present(again, range(10)) == [5, 6, 7]
    assert [tier_load(again, n) for n in (5, 6, 7)] == [(True, chunk_bytes(n)) for n in (5, 6, 7)]
    _close(again)
    # Store order survives (not load order, which lives in memory only): 5 is overwritten first.
    third = make_tier(tmp_path, num_slots=3)
    assert tier_store(third, 8)
    assert _present(third, range(10)) == [6, 7, 8]


def test_restart_with_a_smaller_file_keeps_the_chunks_that_fit(make_tier, tmp_path):
    tier = make_tier(tmp_path, num_slots=4)
    for n in range(4):
        assert tier_store(tier, n)
    _close(tier)
    smaller = make_tier(tmp_path, num_slots=2)
    assert os.path.getsize(smaller.path) == _budget(2)
    assert _present(smaller, range(4)) == [0, 1]  # slots 0 and 1, filled first
    assert tier_load(smaller, 1) == (True, chunk_bytes(1))


def test_a_file_of_another_slot_size_starts_afresh(make_tier, tmp_path):
    tier = make_tier(tmp_path)
    assert tier_store(tier, 1)
    _close(tier)
    bigger_slots = make_tier(tmp_path, max_chunk_bytes=3 * PAGE)
    assert bigger_slots.stride == 4 * PAGE
    assert _present(bigger_slots, [1]) == []


def test_the_slot_file_has_its_namespace_description_beside_it(tmp_path):
    description = {"model": "m", "weights_digest": "ab" * 16, "blocks_per_chunk": 1}
    tier = DiskTier(DiskTierOptions(root_dir=str(tmp_path), max_bytes=_budget(2)),
                    TierContext("disk", NAMESPACE, max_chunk_bytes=CHUNK,
                                description=description))
    tier.shutdown()
    assert sorted(os.listdir(tmp_path)) == [NAMESPACE.hex() + ".json",
                                            NAMESPACE.hex() + ".kvslots"]
    with open(os.path.join(tmp_path, NAMESPACE.hex() + ".json")) as f:
        assert json.load(f) == {**description, "format": "KVTD/2 slots of KVTC/1 chunks"}


def test_other_namespace_uses_its_own_file(make_tier, tmp_path):
    tier = make_tier(tmp_path)
    assert tier_store(tier, 1)
    other = make_tier(tmp_path, namespace=b"other-model" * 3)
    assert other.path != tier.path
    assert other.lookup(key(1)) is LookupResult.NOT_FOUND


def test_second_tier_on_the_same_file_is_refused_until_the_first_closes(make_tier, tmp_path):
    tier = make_tier(tmp_path)
    with pytest.raises(DiskTierInUseError, match="in use by another kvtier instance.*fs=DIR"):
        make_tier(tmp_path)
    _close(tier)
    assert make_tier(tmp_path).lookup(key(1)) is LookupResult.NOT_FOUND


def _flip(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


@pytest.mark.parametrize("where", ["payload", "checksum", "key", "magic"])
def test_damaged_slot_is_a_miss_never_data_and_is_reused(make_tier, tmp_path, where):
    tier = make_tier(tmp_path, num_slots=2)
    assert tier_store(tier, 1)
    slot_start = PAGE + tier._index[key(1)] * STRIDE
    offset = {"payload": PAGE + CHUNK - 1, "checksum": 32, "key": 60, "magic": 0}[where]
    _flip(tier.path, slot_start + offset)
    assert tier_load(tier, 1)[0] is False
    assert tier.lookup(key(1)) is LookupResult.NOT_FOUND  # the failed load dropped the slot
    assert tier_store(tier, 1) and tier_store(tier, 2)  # both fit: the damaged slot was freed
    assert tier_load(tier, 1) == (True, chunk_bytes(1))


def test_a_damaged_slot_dropped_at_load_is_announced_removed(make_manager, tmp_path):
    manager = make_manager(offload_config(1, [{"type": "disk", "root_dir": str(tmp_path),
                                               "max_bytes": _budget(2), "direct_loads": False}]))
    for n in (1, 2):  # 2 takes chunk 1's host slot: the disk alone holds 1
        store_from_device(manager, n)
        drain(manager)
    disk = manager.tiers[0]
    _flip(disk.path, PAGE + disk._index[key(1)] * STRIDE + PAGE)  # its payload
    manager.take_events()
    assert manager.lookup(key(1), CHUNK) is Lookup.RETRY  # its promotion fails the checksum
    assert poll_until(manager, 1) is Lookup.MISS
    assert [e for e in manager.take_events() if e.key == key(1)] == \
        [TierMoveEvent(key(1), "disk", None, "local")]


def test_torn_slot_after_a_crash_is_dropped_at_load(make_tier, tmp_path):
    # A crash between the header and the payload reaching the disk: 2's header, 1's payload.
    # (Found at the first load: with loads straight from the mapped file on, the start-up check
    # drops it before, tests/offload/test_disk_direct_loads.py.)
    tier = make_tier(tmp_path, num_slots=2, direct_loads=False)
    assert tier_store(tier, 1) and tier_store(tier, 2)
    slot1, slot2 = tier._index[key(1)], tier._index[key(2)]
    _close(tier)
    with open(tier.path, "r+b") as f:
        f.seek(PAGE + slot1 * STRIDE + PAGE)
        payload1 = f.read(CHUNK)
        f.seek(PAGE + slot2 * STRIDE + PAGE)
        f.write(payload1)
    again = make_tier(tmp_path, num_slots=2, direct_loads=False)
    assert _present(again, [1, 2]) == [1, 2]  # headers are whole
    assert tier_load(again, 2)[0] is False
    assert _present(again, [1, 2]) == [1]
    assert tier_load(again, 1) == (True, chunk_bytes(1))


def _mix_stores_and_loads(tier, rng):
    """400 stores and loads of 12 chunks at once: (chunk, bytes) of each load that succeeded."""
    jobs, expected = [], {}
    for _ in range(400):
        n = rng.randrange(12)
        if rng.random() < 0.5:
            job = tier_job(n)
            tier.submit_store(job)
        else:
            job = tier_job(n, memoryview(bytearray(CHUNK)))
            expected[job.job_id] = (n, job.buffer)
            tier.submit_load(job)
        jobs.append(job.job_id)
    results = wait_jobs(tier, jobs, timeout=30)
    return [(n, bytes(buffer)) for job_id, (n, buffer) in expected.items() if results[job_id]]


def test_concurrent_stores_and_loads_never_return_wrong_bytes(make_tier, tmp_path):
    tier = make_tier(tmp_path, num_slots=4, num_read_threads=4, num_write_threads=4)
    # Chunks on disk before the mix starts: reads (not niced) can run ahead of every write
    # of the mix, and then some of them still find what they ask for. Which loads find their
    # chunk is up to the threads (14-76 of 212 in ten runs); a mix in which none did proves
    # nothing and is run again.
    for n in range(4):
        assert tier_store(tier, n)
    rng = random.Random(0)
    for _ in range(3):
        loaded = _mix_stores_and_loads(tier, rng)
        assert all(data == chunk_bytes(n) for n, data in loaded)
        if loaded:
            break
    assert loaded, "no load succeeded in three mixes: the test proves nothing"
    assert len(tier._index) + len(tier._free) == tier.num_slots
    assert not tier._readers_of and not tier._orphans


def test_budget_below_one_slot_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"disk.max_bytes=8192 holds no chunk; it must be at "
                                         r"least 12288 bytes"):
        DiskTier(DiskTierOptions(root_dir=str(tmp_path), max_bytes=8192),
                 TierContext("disk", NAMESPACE, max_chunk_bytes=CHUNK))


def test_options_need_a_size(tmp_path):
    with pytest.raises(ValueError, match="missing required key 'max_bytes'"):
        parse_options(DiskTierOptions, {"root_dir": str(tmp_path)}, "secondary_tiers[0]")
    assert DiskTierOptions(root_dir="/x", max_bytes="1MiB").max_bytes == 2**20


_NO_SPACE = textwrap.dedent("""
    import resource, signal
    from tests.offload.offload_helpers import CHUNK, NAMESPACE
    from kvtier.offload.tiers.base import TierContext
    from kvtier.offload.tiers.disk import DiskTier, DiskTierOptions
    # A file-size limit below the slot file: reserving it fails like on a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (8192, resource.RLIM_INFINITY))
    try:
        DiskTier(DiskTierOptions(root_dir={root!r}, max_bytes="1MiB"),
                 TierContext("disk", NAMESPACE, max_chunk_bytes=CHUNK))
    except ValueError as exc:
        print(type(exc).__name__, exc)
""")


def test_no_room_for_the_file_is_a_clear_start_up_error(tmp_path):
    out = subprocess.run([sys.executable, "-c", _NO_SPACE.format(root=str(tmp_path))],
                         cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    assert out.stdout.startswith("DiskTierSetupError cannot reserve") \
        and "lower its size or free space" in out.stdout, out.stdout + out.stderr


def test_unwritable_directory_is_a_clear_start_up_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    with pytest.raises(DiskTierSetupError, match="cannot create the disk tier's directory .*"
                                                  "choose a writable directory"):
        DiskTier(DiskTierOptions(root_dir=str(blocker / "cache"), max_bytes="1MiB"),
                 TierContext("disk", NAMESPACE, max_chunk_bytes=CHUNK))


# ---- one directory, one budget: other namespaces' files -------------------------------------


def _kvslots(root):
    return sorted(name for name in os.listdir(root) if name.endswith(".kvslots"))


def test_unused_slot_files_of_other_namespaces_are_removed_at_start_up(make_tier, tmp_path,
                                                                        caplog):
    old = make_tier(tmp_path, num_slots=8, namespace=b"old-model" * 4)
    assert tier_store(old, 1)
    _close(old)
    description = tmp_path / (os.path.basename(old.path)[:-len(".kvslots")] + ".json")
    description.write_text("{}")
    (tmp_path / "unrelated").write_text("kept")
    with caplog.at_level("INFO", logger="kvtier.offload.tiers.slot_dir"):
        new = make_tier(tmp_path, num_slots=8)
    assert _kvslots(tmp_path) == [os.path.basename(new.path)]
    assert not description.exists() and (tmp_path / "unrelated").read_text() == "kept"
    assert f"removed 1 slot file(s) of other namespaces that no instance uses from {tmp_path}, " \
           f"freeing {_budget(8)} bytes: {os.path.basename(old.path)}" in caplog.text


_HOLD = "import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR); " \
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); sys.stdin.read()"


def test_a_slot_file_another_process_holds_is_left_alone(make_tier, tmp_path, caplog):
    other = make_tier(tmp_path, namespace=b"other-model" * 3)
    _close(other)
    holder = subprocess.Popen([sys.executable, "-c", _HOLD, other.path],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with caplog.at_level("WARNING", logger="kvtier.offload.tiers.slot_dir"):
            _close(make_tier(tmp_path))
        assert os.path.exists(other.path)
        assert f"1 slot file(s) of other namespaces in {tmp_path} ({_budget(8)} bytes) are in " \
               f"use by other instances and left alone" in caplog.text
    finally:
        holder.communicate("", timeout=60)
    third = make_tier(tmp_path, namespace=b"third-model" * 3)  # its holder has exited
    assert _kvslots(tmp_path) == [os.path.basename(third.path)]


def test_a_slot_file_removed_between_open_and_lock_is_opened_again(make_tier, tmp_path,
                                                                    monkeypatch):
    import fcntl

    real_flock, removed = fcntl.flock, []

    def flock_after_a_removal(fd, operation):
        if not removed:  # another instance's start-up removes the file it found unused
            removed.append(os.path.join(tmp_path, NAMESPACE.hex() + ".kvslots"))
            os.unlink(removed[0])
        return real_flock(fd, operation)

    monkeypatch.setattr(fcntl, "flock", flock_after_a_removal)
    tier = make_tier(tmp_path)
    monkeypatch.undo()
    assert removed == [tier.path]
    assert os.path.samestat(os.fstat(tier._fd), os.stat(tier.path))  # not the removed file
