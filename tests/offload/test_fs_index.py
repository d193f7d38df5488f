"""FsIndex alone: what it remembers and for how long, and what its waits cost."""

import threading
import time

import pytest

from kvtier.offload.tiers import fs_index
from kvtier.offload.tiers.base import LookupResult
from kvtier.offload.tiers.fs_index import FsIndex

FOUND, NOT_FOUND, UNKNOWN = LookupResult.FOUND, LookupResult.NOT_FOUND, LookupResult.UNKNOWN


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Disk:
    """`exists` for an FsIndex: the names in `files`; with `gate` cleared, a stat blocks on it."""

    def __init__(self, *files: str) -> None:
        self.files = set(files)
        self.gate = threading.Event()
        self.gate.set()
        self.num_stats = 0

    def exists(self, name: str) -> bool:
        self.num_stats += 1
        assert self.gate.wait(10), "the test never opened the gate"
        return name in self.files


@pytest.fixture
def make_index():
    indexes = []

    def make(disk, clock=time.monotonic):
        indexes.append(FsIndex(disk.exists, "test-probe", "test", clock))
        return indexes[-1]

    yield make
    for index in indexes:
        assert index.shutdown(5)


def settled(index, name):
    deadline = time.monotonic() + 10
    while (answer := index.lookup(name)) is UNKNOWN:
        assert time.monotonic() < deadline
        time.sleep(0.002)
    return answer


def test_answers_are_trusted_for_a_while_then_checked_again(make_index):
    clock, disk = Clock(), Disk("a")
    index = make_index(disk, clock)
    index.remember("a", True)
    index.remember("b", False)
    assert [index.lookup("a"), index.lookup("b")] == [FOUND, NOT_FOUND]
    assert disk.num_stats == 0
    clock.now += fs_index._ABSENT_S
    assert index.lookup("a") is FOUND and settled(index, "b") is NOT_FOUND
    assert disk.num_stats == 1
    disk.files.discard("a")  # another instance deleted it
    clock.now += fs_index._FOUND_S
    assert settled(index, "a") is NOT_FOUND


def test_a_stat_that_began_before_a_store_does_not_undo_it(make_index):
    disk = Disk()
    disk.gate.clear()
    index = make_index(disk)
    assert index.lookup("a") is UNKNOWN  # the stat sees no file, and returns late
    index.remember("a", True)  # a store of it ended meanwhile
    disk.gate.set()
    deadline = time.monotonic() + 10
    while index._pending and time.monotonic() < deadline:
        time.sleep(0.002)
    assert index.lookup("a") is FOUND


def test_forgetting_everything(make_index):
    disk = Disk()
    index = make_index(disk)
    index.remember("a", True)
    index.clear()
    assert settled(index, "a") is NOT_FOUND


class SlowDisk(Disk):
    def __init__(self, stat_s: float) -> None:
        super().__init__()
        self.stat_s = stat_s

    def exists(self, name):
        time.sleep(self.stat_s)  # a struggling NFS server
        return False


def lookup_200(index):
    """A 200-chunk prompt never seen here: the answers, and the seconds they took."""
    start = time.monotonic()
    answers = [index.lookup(str(n)) for n in range(200)]
    return answers, time.monotonic() - start


def test_lookups_behind_a_slow_stat_do_not_wait(make_index):
    answers, took = lookup_200(make_index(SlowDisk(0.02)))
    assert answers == [UNKNOWN] * 200
    # A wait per lookup would take 200 x 2 ms: only the first waits, the rest queue behind it.
    assert took < 0.1, took


def test_waits_in_a_row_share_a_budget(make_index):
    answers, took = lookup_200(make_index(SlowDisk(0.001)))
    # Each stat answers within a lookup's wait, so a wait per lookup would take 200 x 1 ms:
    # after the first ~2 ms the lookups wait 5% of the time that passed.
    assert UNKNOWN in answers
    assert took < 0.1, took
