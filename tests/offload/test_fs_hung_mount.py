"""The fs tier on a mount that stops answering (an NFS server gone): the engine's thread never
waits on it. A hung mount is simulated by an `os.stat` that blocks, for the tier's chunk files,
until the test releases it (at most HANG_S)."""

import logging
import os
import threading
import time

import pytest

from kvtier.offload.tiers.base import LookupResult, TierContext
from kvtier.offload.tiers.fs import FsTier, FsTierOptions

from .offload_helpers import NAMESPACE, chunk_bytes, key, settled_lookup, tier_load, tier_store

# How long a simulated stat hangs at most, so that a test of a tier that waits fails, not hangs.
HANG_S = 10.0
# What "at once" means for a call on the engine's thread: far under HANG_S, far over the tier's
# own waits (milliseconds), for a loaded test machine.
PROMPT_S = 0.5


class HungMount:
    """`os.stat` of the paths under `directory` blocks until `release()`; counted in `num_stats`."""

    def __init__(self, directory: str, monkeypatch) -> None:
        self.prefix = directory + os.sep
        self.entered = threading.Event()
        self.released = threading.Event()
        self.hung = True
        self.num_stats = 0
        real = os.stat

        def stat(path, *args, **kwargs):
            if isinstance(path, str) and path.startswith(self.prefix):
                self.num_stats += 1
                if self.hung:
                    self.entered.set()
                    self.released.wait(HANG_S)
            return real(path, *args, **kwargs)

        monkeypatch.setattr(os, "stat", stat)

    def release(self) -> None:
        self.hung = False
        self.released.set()


@pytest.fixture
def make_tier():
    tiers, mounts = [], []

    def make(root, hang=None, **options):
        tier = FsTier(FsTierOptions(root_dir=str(root), **options),
                      TierContext("fs", NAMESPACE))
        tiers.append(tier)
        if hang is not None:
            mounts.append(HungMount(tier.directory, hang))
        return tier

    yield make
    for mount in mounts:
        mount.release()
    for tier in tiers:
        tier.shutdown()


def at_once(call, *args):
    """`call(*args)`, which must return at once (it is made on the engine's thread)."""
    start = time.monotonic()
    result = call(*args)
    took = time.monotonic() - start
    assert took < PROMPT_S, f"{call.__name__} took {took:.2f} s: it waited on the hung mount"
    return result


def test_lookups_on_a_hung_mount_return_at_once_and_recover(make_tier, tmp_path, monkeypatch,
                                                            caplog):
    assert tier_store(make_tier(tmp_path), 2)  # another instance's chunk
    tier = make_tier(tmp_path)
    assert tier_store(tier, 1)
    mount = HungMount(tier.directory, monkeypatch)
    # Its stat hangs in the probe thread; the scheduler asks again next step.
    assert at_once(tier.lookup, key(2)) is LookupResult.UNKNOWN
    assert mount.entered.wait(HANG_S)
    assert at_once(tier.lookup, key(3)) is LookupResult.UNKNOWN  # queued behind it
    assert at_once(tier.lookup, key(1)) is LookupResult.FOUND  # stored here: no stat
    deadline = time.monotonic() + HANG_S / 2
    with caplog.at_level(logging.WARNING, logger="kvtier.offload.tiers.fs_index"):
        # Until the stat has hung long enough to give up on the mount.
        while (answer := at_once(tier.lookup, key(3))) is not LookupResult.NOT_FOUND:
            assert answer is LookupResult.UNKNOWN and time.monotonic() < deadline
            time.sleep(0.05)
        assert [at_once(tier.lookup, key(n)) for n in (1, 2, 4)] == [LookupResult.NOT_FOUND] * 3
        assert at_once(tier_load, tier, 1)[0] is False  # a job would hang there too
        assert at_once(tier_store, tier, 5) is False
        mount.release()
        while tier.lookup(key(2)) is not LookupResult.FOUND:  # the hung stat's answer
            assert time.monotonic() < deadline, "the tier never recovers"
            time.sleep(0.01)
    assert "has not answered a stat for 1 s" in caplog.text
    assert "lookups and jobs resume" in caplog.text
    assert [settled_lookup(tier, n) for n in (1, 4, 5)] == \
        [LookupResult.FOUND, LookupResult.NOT_FOUND, LookupResult.NOT_FOUND]
    assert tier_load(tier, 2) == (True, chunk_bytes(2))


def test_a_hung_mount_holds_no_more_than_the_bounded_pending_keys(make_tier, tmp_path,
                                                                  monkeypatch):
    monkeypatch.setattr("kvtier.offload.tiers.fs_index._MAX_PENDING", 4)
    tier = make_tier(tmp_path, hang=monkeypatch)
    answers = [at_once(tier.lookup, key(n)) for n in range(100)]
    assert answers == [LookupResult.UNKNOWN] * 4 + [LookupResult.NOT_FOUND] * 96
    assert tier.lookup(key(2)) is LookupResult.UNKNOWN  # still waiting for its stat


def test_a_stored_or_loaded_chunk_is_found_without_a_stat(make_tier, tmp_path, monkeypatch):
    tier = make_tier(tmp_path)
    assert tier_store(tier, 1) and tier_store(make_tier(tmp_path), 2)
    assert tier_load(tier, 2)[0]
    mount = HungMount(tier.directory, monkeypatch)
    mount.release()  # counts the stats, blocks none
    assert [tier.lookup(key(n)) for n in (1, 2)] == [LookupResult.FOUND] * 2
    assert mount.num_stats == 0


def test_a_chunk_on_the_disk_is_found_within_the_lookup(make_tier, tmp_path, monkeypatch):
    # The real wait is 2 ms, ~100 times a local stat through the probe thread; here it is long,
    # so that a loaded test machine does not turn the answer into UNKNOWN.
    monkeypatch.setattr("kvtier.offload.tiers.fs_index._WAIT_S", HANG_S)
    monkeypatch.setattr("kvtier.offload.tiers.fs_index._WAIT_BURST_S", HANG_S)
    assert tier_store(make_tier(tmp_path), 1)
    tier = make_tier(tmp_path)
    assert tier.lookup(key(1)) is LookupResult.FOUND
    assert tier.lookup(key(2)) is LookupResult.NOT_FOUND


def test_a_file_another_instance_deletes_is_a_miss_once_its_answer_expires(make_tier, tmp_path,
                                                                           monkeypatch):
    tier = make_tier(tmp_path)
    assert tier_store(tier, 1)
    os.unlink(tier.path_for(key(1)))  # another instance evicts it
    assert tier.lookup(key(1)) is LookupResult.FOUND  # trusted for a while: a failed load
    monkeypatch.setattr("kvtier.offload.tiers.fs_index._FOUND_S", 0.0)
    assert settled_lookup(tier, 1) is LookupResult.NOT_FOUND


def test_shutdown_abandons_a_probe_stuck_in_a_stat(tmp_path, monkeypatch):
    tier = FsTier(FsTierOptions(root_dir=str(tmp_path)), TierContext("fs", NAMESPACE))
    mount = HungMount(tier.directory, monkeypatch)
    try:
        assert tier.lookup(key(1)) is LookupResult.UNKNOWN
        assert mount.entered.wait(HANG_S)
        start = time.monotonic()
        assert tier.shutdown() is False
        assert time.monotonic() - start < HANG_S / 2
    finally:
        mount.release()
