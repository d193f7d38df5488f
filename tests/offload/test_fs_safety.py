"""The file tiers in a directory others may write, on a read-only mount and on a full disk:
nothing is written or deleted outside the root, a read-only directory is a read-only tier, a
full disk evicts and retries, and the used-bytes gauge is right from start-up."""

import logging
import os
import shutil
import stat
import time

import pytest

from kvtier.engine.metrics import MetricsRegistry
from kvtier.offload.tiers.base import LookupResult, TierContext
from kvtier.offload.tiers.disk import DiskTier, DiskTierOptions, DiskTierSetupError
from kvtier.offload.tiers.fs import FsTier, FsTierOptions

from .mounts import bind_mount, read_only_view, remounted_read_only, small_tmpfs
from .offload_helpers import (
    CHUNK,
    NAMESPACE,
    chunk_bytes,
    key,
    offload_config,
    settled_lookup,
    store_from_device,
    tier_job,
    tier_load,
    tier_store,
)


@pytest.fixture
def make_fs():
    tiers = []

    def make(root, metrics=None, **options):
        tier = FsTier(FsTierOptions(root_dir=str(root), **options),
                      TierContext("fs", NAMESPACE, metrics))
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.shutdown()


def _store_result(tier, n):
    """The JobResult of storing chunk n."""
    job = tier_job(n)
    tier.submit_store(job)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for result in tier.get_finished_jobs():
            assert result.job_id == job.job_id
            return result
        time.sleep(0.002)
    raise AssertionError("store job never reported")


def _outside(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim.kvc").write_bytes(b"precious")
    os.utime(outside / "victim.kvc", (1000, 1000))  # older than any chunk: evicted first
    return outside


def _chunk_files(root):
    return {os.path.join(d, name): os.path.getsize(os.path.join(d, name))
            for d, _, names in os.walk(root) for name in names if name.endswith(".kvc")}


# ---- symlinks ---------------------------------------------------------------------------------


def test_fs_tier_never_writes_through_a_symlinked_subdirectory(make_fs, tmp_path):
    outside = _outside(tmp_path)
    tier = make_fs(tmp_path / "cache")
    os.makedirs(tier.directory, exist_ok=True)
    os.symlink(outside, os.path.dirname(tier.path_for(key(1))))
    assert tier_store(tier, 1) is False
    assert os.listdir(outside) == ["victim.kvc"]
    # A valid chunk file placed behind the symlink is refused at load too.
    other = make_fs(tmp_path / "elsewhere")
    assert tier_store(other, 1)
    os.replace(other.path_for(key(1)), outside / os.path.basename(tier.path_for(key(1))))
    assert tier_load(tier, 1)[0] is False


def test_fs_eviction_never_deletes_through_a_symlinked_subdirectory(make_fs, tmp_path, caplog):
    outside = _outside(tmp_path)
    probe = make_fs(tmp_path / "probe")
    assert tier_store(probe, 0)
    file_bytes = os.path.getsize(probe.path_for(key(0)))
    tier = make_fs(tmp_path / "cache", max_bytes=3 * file_bytes)
    os.makedirs(tier.directory, exist_ok=True)
    os.symlink(outside, os.path.join(tier.directory, "zz"))
    with caplog.at_level(logging.WARNING, logger="kvtier.offload.tiers.fs"):
        for n in range(6):
            assert tier_store(tier, n)
    assert (outside / "victim.kvc").read_bytes() == b"precious"
    assert len(_chunk_files(tier.directory)) <= 3  # the budget is kept with the files inside
    assert caplog.text.count("is a symlink") == 1


def test_fs_store_replaces_a_symlinked_chunk_file_never_its_target(make_fs, tmp_path):
    outside = _outside(tmp_path)
    tier = make_fs(tmp_path / "cache")
    assert tier_store(tier, 2)  # creates the namespace's subdirectories as a store does
    path = tier.path_for(key(1))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    os.symlink(outside / "victim.kvc", path)
    assert settled_lookup(tier, 1) is LookupResult.NOT_FOUND
    assert tier_load(tier, 1)[0] is False
    assert tier_store(tier, 1)
    assert (outside / "victim.kvc").read_bytes() == b"precious"
    assert not os.path.islink(path) and tier_load(tier, 1) == (True, chunk_bytes(1))


def test_fs_files_are_private_to_the_owner(make_fs, tmp_path):
    tier = make_fs(tmp_path / "cache")
    assert tier_store(tier, 1)
    path = tier.path_for(key(1))
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    for directory in (tier.root, tier.directory, os.path.dirname(path)):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700


def test_fs_root_that_is_a_symlink_to_a_directory_is_normal(make_fs, tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    tier = make_fs(tmp_path / "link")
    assert tier_store(tier, 1) and tier_load(tier, 1) == (True, chunk_bytes(1))
    assert tier.root == str(tmp_path / "real")


def test_disk_tier_refuses_a_symlink_in_place_of_its_file(tmp_path):
    outside = _outside(tmp_path)
    root = tmp_path / "disk"
    root.mkdir()
    os.symlink(outside / "victim.kvc", root / (NAMESPACE.hex() + ".kvslots"))
    with pytest.raises(DiskTierSetupError, match="is a symlink; refused"):
        DiskTier(DiskTierOptions(root_dir=str(root), max_bytes="1MiB"),
                 TierContext("disk", NAMESPACE, max_chunk_bytes=CHUNK))
    assert (outside / "victim.kvc").read_bytes() == b"precious"


def test_disk_tier_file_is_private_to_the_owner(tmp_path):
    tier = DiskTier(DiskTierOptions(root_dir=str(tmp_path / "disk"), max_bytes="1MiB"),
                    TierContext("disk", NAMESPACE, max_chunk_bytes=CHUNK))
    tier.shutdown()
    assert stat.S_IMODE(os.stat(tier.path).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(tmp_path / "disk").st_mode) == 0o700


# ---- what others may put in the directory or take from it -------------------------------------


def test_fs_fifo_in_place_of_a_chunk_file_fails_its_load_at_once(make_fs, tmp_path):
    tier = make_fs(tmp_path, num_read_threads=1)
    assert tier_store(tier, 1) and tier_store(tier, 2)
    assert tier.lookup(key(1)) is LookupResult.FOUND
    path = tier.path_for(key(1))
    os.unlink(path)
    os.mkfifo(path, 0o600)  # after the lookup: the load opens it
    assert tier_load(tier, 1)[0] is False  # not a thread blocked in open() for good
    assert tier_load(tier, 2) == (True, chunk_bytes(2))  # the one read thread is free
    assert tier.lookup(key(1)) is LookupResult.NOT_FOUND
    assert tier_store(tier, 1) and tier_load(tier, 1) == (True, chunk_bytes(1))


@pytest.mark.parametrize("removed", ["root", "namespace"])
def test_fs_directory_removed_at_run_time_is_made_again_by_a_store(make_fs, tmp_path, removed,
                                                                  caplog):
    tier = make_fs(tmp_path / "cache")
    assert tier_store(tier, 1)
    shutil.rmtree(tier.root if removed == "root" else tier.directory)
    assert tier_load(tier, 1)[0] is False  # gone: a miss, and a load makes nothing
    assert not os.path.exists(tier.directory)
    with caplog.at_level(logging.WARNING, logger="kvtier.offload.tiers.fs"):
        assert tier_store(tier, 2)
    assert "was removed; making it again" in caplog.text
    assert tier_load(tier, 2) == (True, chunk_bytes(2))
    for directory in (tier.root, tier.directory):
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700


def test_fs_namespace_directory_replaced_by_a_symlink_is_never_written(make_fs, tmp_path):
    outside = _outside(tmp_path)
    tier = make_fs(tmp_path / "cache")
    assert tier_store(tier, 1)
    shutil.rmtree(tier.directory)
    os.symlink(outside, tier.directory)
    assert tier_store(tier, 2) is False
    assert os.listdir(outside) == ["victim.kvc"]


# ---- read-only directories ---------------------------------------------------------------------


def test_read_only_mount_is_a_read_only_tier(make_fs, tmp_path):
    writer = make_fs(tmp_path / "shared")
    assert tier_store(writer, 1)
    before = _chunk_files(tmp_path / "shared")
    with read_only_view(tmp_path / "shared", tmp_path / "ro") as ro:
        tier = make_fs(ro)
        assert settled_lookup(tier, 1) is LookupResult.FOUND
        assert tier_load(tier, 1) == (True, chunk_bytes(1))  # the access-time touch fails
        assert tier.read_only
        result = _store_result(tier, 2)
        assert (result.ok, result.skipped) == (False, "read_only")
        tier.shutdown()
    assert _chunk_files(tmp_path / "shared") == before


def test_read_only_tier_skips_are_counted_not_errors(make_manager, tmp_path):
    (tmp_path / "shared").mkdir()
    with read_only_view(tmp_path / "shared", tmp_path / "ro") as ro:
        manager = make_manager(offload_config(2, [{"type": "fs", "root_dir": str(ro)}]))
        store_from_device(manager, 1)
        deadline = time.monotonic() + 10
        while manager.num_jobs_in_flight() and time.monotonic() < deadline:
            manager.poll()
            time.sleep(0.002)
        stats = manager.metrics.snapshot()
    assert stats['kvtier:offload_tier_dropped_stores_total{tier="fs",reason="read_only"}'] == 1
    assert stats.get('kvtier:offload_tier_errors_total{tier="fs"}', 0) == 0


def test_a_mount_turning_read_only_makes_the_tier_read_only(make_fs, tmp_path, caplog):
    (tmp_path / "shared").mkdir()
    with bind_mount(tmp_path / "shared", tmp_path / "mnt") as mnt:
        tier = make_fs(mnt)
        assert not tier.read_only and tier_store(tier, 1)
        with remounted_read_only(mnt), \
                caplog.at_level(logging.WARNING, logger="kvtier.offload.tiers.fs"):
            assert _store_result(tier, 2).skipped == "read_only"
            assert _store_result(tier, 3).skipped == "read_only"
            assert tier.read_only
            assert tier_load(tier, 1) == (True, chunk_bytes(1))
        tier.shutdown()
    assert caplog.text.count("the tier is read-only from now on") == 1


# ---- a full disk --------------------------------------------------------------------------------


def test_full_disk_evicts_the_oldest_chunks_and_retries(make_fs, tmp_path, caplog):
    with small_tmpfs(tmp_path / "small", "64k") as small, \
            caplog.at_level(logging.WARNING, logger="kvtier.offload.tiers.fs"):
        tier = make_fs(small)
        for n in range(40):  # a chunk file takes a 4 KiB page: 16 fit
            assert tier_store(tier, n), f"store {n} failed"
            os.utime(tier.path_for(key(n)), (1000 + n, 1000 + n))  # store order = age
        assert tier.lookup(key(0)) is LookupResult.NOT_FOUND
        assert tier.lookup(key(39)) is LookupResult.FOUND
        assert tier_load(tier, 39) == (True, chunk_bytes(39))
        tier.shutdown()
    assert caplog.text.count("No space left on device") == 1  # at most once a minute


# ---- the used-bytes gauge ----------------------------------------------------------------------


def _gauge(registry):
    return registry.snapshot().get('kvtier:offload_fs_used_bytes{tier="fs"}')


def test_used_bytes_gauge_after_a_restart_equals_the_bytes_on_disk(make_fs, tmp_path):
    first = make_fs(tmp_path, MetricsRegistry())
    for n in range(5):
        assert tier_store(first, n)
    first.shutdown()
    on_disk = sum(_chunk_files(tmp_path).values())
    registry = MetricsRegistry()
    make_fs(tmp_path, registry)  # no store: the gauge is set by the start-up scan alone
    deadline = time.monotonic() + 10
    while _gauge(registry) != on_disk and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _gauge(registry) == on_disk > 0
