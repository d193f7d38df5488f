import json
import os
import subprocess
import sys
import textwrap
import threading

import pytest

from kvtier.offload.tiers.base import LookupResult, TierContext
from kvtier.offload.tiers.fs import FsTier, FsTierOptions, FsTierSetupError

from .offload_helpers import (
    CHUNK,
    NAMESPACE,
    chunk_bytes,
    key,
    settled_lookup,
    tier_job,
    tier_load,
    tier_store,
    wait_jobs,
)

# The scripts below run with `python -c` in the repository root, so they import kvtier and the
# helpers as this module does.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def make_tier():
    tiers = []

    def make(root, **options):
        tier = FsTier(FsTierOptions(root_dir=str(root), **options),
                      TierContext("fs", NAMESPACE))
        tiers.append(tier)
        return tier

    yield make
    for tier in tiers:
        tier.shutdown()


def test_store_then_load_round_trip(make_tier, tmp_path):
    tier = make_tier(tmp_path)
    assert settled_lookup(tier, 1) is LookupResult.NOT_FOUND
    assert tier_store(tier, 1)
    assert tier.lookup(key(1)) is LookupResult.FOUND
    assert tier_load(tier, 1) == (True, chunk_bytes(1))
    path = tier.path_for(key(1))
    assert path.startswith(os.path.join(str(tmp_path), NAMESPACE.hex()))
    assert [name for name in os.listdir(os.path.dirname(path)) if name.endswith(".tmp")] == []


def test_a_budget_that_holds_no_chunk_file_is_refused_at_start(tmp_path):
    # A 64-byte chunk's file takes 166 bytes (header, 66-byte key): a budget of exactly that
    # would be evicted down to 90% of it, below the file, at once.
    with pytest.raises(ValueError, match=r"^fs\.max_bytes=166 holds no chunk: a chunk file "
                                         r"takes up to 166 bytes and eviction keeps 90% of the "
                                         r"budget, so it must be at least 185 bytes"):
        FsTier(FsTierOptions(root_dir=str(tmp_path), max_bytes=166),
               TierContext("fs", NAMESPACE, max_chunk_bytes=CHUNK))


def test_the_smallest_budget_allowed_keeps_a_chunk(tmp_path):
    tier = FsTier(FsTierOptions(root_dir=str(tmp_path), max_bytes=185),
                  TierContext("fs", NAMESPACE, max_chunk_bytes=CHUNK))
    try:
        assert tier_store(tier, 1)
        assert os.path.getsize(tier.path_for(key(1))) == 166
        assert tier_load(tier, 1) == (True, chunk_bytes(1))
    finally:
        tier.shutdown()


def test_the_first_store_describes_the_namespace_beside_the_chunks(tmp_path):
    description = {"model": "m", "weights_digest": "ab" * 16, "blocks_per_chunk": 2}
    tier = FsTier(FsTierOptions(root_dir=str(tmp_path)),
                  TierContext("fs", NAMESPACE, description=description))
    path = os.path.join(tier.directory, NAMESPACE.hex() + ".json")
    assert not os.path.exists(path)  # nothing on disk before there is data
    assert tier_store(tier, 1) and tier_store(tier, 2)
    with open(path) as f:
        assert json.load(f) == {**description, "format": "KVTC/1"}
    assert tier_load(tier, 1) == (True, chunk_bytes(1))  # the chunks' scan skips it
    tier.shutdown()


def test_other_namespace_never_sees_the_files(make_tier, tmp_path):
    assert tier_store(make_tier(tmp_path), 1)
    other = FsTier(FsTierOptions(root_dir=str(tmp_path)),
                   TierContext("fs", b"other-model" * 3))
    assert settled_lookup(other, 1) is LookupResult.NOT_FOUND
    other.shutdown()


@pytest.mark.parametrize("damage", ["flip", "truncate", "delete", "swap_key"])
def test_damaged_file_is_a_miss_never_data(make_tier, tmp_path, damage):
    tier = make_tier(tmp_path)
    assert tier_store(tier, 1) and tier_store(tier, 2)
    path = tier.path_for(key(1))
    if damage == "flip":
        with open(path, "r+b") as f:
            f.seek(-5, os.SEEK_END)
            byte = f.read(1)
            f.seek(-5, os.SEEK_END)
            f.write(bytes([byte[0] ^ 0xFF]))
    elif damage == "truncate":
        os.truncate(path, os.path.getsize(path) - 10)
    elif damage == "delete":
        os.unlink(path)
    else:  # a whole, valid file of another chunk under this chunk's name
        os.replace(tier.path_for(key(2)), path)
    ok, data = tier_load(tier, 1)
    assert not ok
    if damage in ("flip", "swap_key"):
        assert not os.path.exists(path)  # dropped, so a later store writes a good one
    assert tier.lookup(key(1)) is LookupResult.NOT_FOUND
    assert tier_store(tier, 1) and tier_load(tier, 1) == (True, chunk_bytes(1))


def test_concurrent_writers_of_one_chunk_threads(make_tier, tmp_path):
    tiers = [make_tier(tmp_path, num_write_threads=4) for _ in range(2)]
    jobs = [(tier, tier_job(5)) for tier in tiers for _ in range(16)]
    barrier = threading.Barrier(len(tiers))

    def submit_all(tier):
        barrier.wait(timeout=10)
        for owner, job in jobs:
            if owner is tier:
                tier.submit_store(job)

    threads = [threading.Thread(target=submit_all, args=(t,)) for t in tiers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    for tier in tiers:
        assert all(wait_jobs(tier, [j.job_id for o, j in jobs if o is tier]).values())
    assert tier_load(tiers[0], 5) == (True, chunk_bytes(5))


_WRITER = textwrap.dedent("""
    import time
    from tests.offload.offload_helpers import CHUNK, NAMESPACE, chunk_bytes, key
    from kvtier.offload.tiers.base import TierContext, TransferJob
    from kvtier.offload.tiers.fs import FsTier, FsTierOptions
    tier = FsTier(FsTierOptions(root_dir={root!r}), TierContext("fs", NAMESPACE))
    jobs = [TransferJob(i, key(n), memoryview(chunk_bytes(n)), time.monotonic() + 30)
            for i, n in enumerate([9] * 20 + list(range(20, 30)))]
    for job in jobs:
        tier.submit_store(job)
    done, deadline = [], time.monotonic() + 30
    while len(done) < len(jobs) and time.monotonic() < deadline:
        done += [r.ok for r in tier.get_finished_jobs()]
        time.sleep(0.002)
    tier.shutdown()
    print(sum(done), len(jobs))
""")


def test_concurrent_writers_of_one_chunk_two_processes(tmp_path):
    script = _WRITER.format(root=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", script], cwd=REPO_ROOT,
                              stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outputs = [proc.communicate(timeout=60)[0].split() for proc in procs]
    assert outputs == [["30", "30"], ["30", "30"]]
    tier = FsTier(FsTierOptions(root_dir=str(tmp_path)), TierContext("fs", NAMESPACE))
    try:
        for n in [9] + list(range(20, 30)):
            assert tier_load(tier, n) == (True, chunk_bytes(n))
    finally:
        tier.shutdown()


def test_byte_budget_evicts_least_recently_used_files(make_tier, tmp_path):
    file_bytes = os.path.getsize(_stored_path(make_tier(tmp_path / "probe"), 0))
    tier = make_tier(tmp_path / "cache", max_bytes=4 * file_bytes)
    for n in range(4):
        assert tier_store(tier, n)
        os.utime(tier.path_for(key(n)), (1000 + n, 1000 + n))  # distinct access times
    assert tier_load(tier, 0)[0]  # loading bumps 0 to most recent
    assert tier_store(tier, 4)  # 5 files > budget: evict down to 90% = 3 files
    present = [n for n in range(5) if tier.lookup(key(n)) is LookupResult.FOUND]
    assert present == [0, 3, 4]


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_write_threads_yield_the_cpu_and_read_threads_do_not(make_tier, tmp_path):
    base = os.getpriority(os.PRIO_PROCESS, 0)
    tier = make_tier(tmp_path, write_nice=5)
    assert tier_store(tier, 1)  # the pool's threads start with the first job
    in_writer = tier._writers.submit(os.getpriority, os.PRIO_PROCESS, 0).result(timeout=10)
    in_reader = tier._readers.submit(os.getpriority, os.PRIO_PROCESS, 0).result(timeout=10)
    assert (in_writer, in_reader) == (min(19, base + 5), base)
    assert os.getpriority(os.PRIO_PROCESS, 0) == base  # the engine's thread is untouched


@pytest.mark.parametrize("bad", [-1, 20, 2.5, True])
def test_write_nice_out_of_range_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match=r"fs\.write_nice must be an integer in 0\.\.19"):
        FsTierOptions(root_dir=str(tmp_path), write_nice=bad)


def _stored_path(tier, n):
    assert tier_store(tier, n)
    return tier.path_for(key(n))


def test_a_directory_that_cannot_be_created_is_refused_at_start_up(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_bytes(b"not a directory")
    with pytest.raises(FsTierSetupError, match="cannot create the fs tier's directory"):
        FsTier(FsTierOptions(root_dir=str(blocker / "cache")), TierContext("fs", NAMESPACE))


_FULL_DISK = textwrap.dedent("""
    import resource, signal, time
    from tests.offload.offload_helpers import CHUNK, NAMESPACE, chunk_bytes, key, settled_lookup
    from kvtier.offload.tiers.base import TierContext, TransferJob
    from kvtier.offload.tiers.fs import FsTier, FsTierOptions
    # A file-size limit below one chunk file: every write fails like on a full disk.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (CHUNK // 2, resource.RLIM_INFINITY))
    tier = FsTier(FsTierOptions(root_dir={root!r}), TierContext("fs", NAMESPACE))
    tier.submit_store(TransferJob(0, key(1), memoryview(chunk_bytes(1)), time.monotonic() + 30))
    results, deadline = [], time.monotonic() + 30
    while not results and time.monotonic() < deadline:
        results = list(tier.get_finished_jobs())
        time.sleep(0.002)
    print(results[0].ok, results[0].error.split(":")[0], settled_lookup(tier, 1).name)
    tier.shutdown()
""")


def test_full_disk_fails_the_store_and_leaves_no_file(tmp_path):
    script = _FULL_DISK.format(root=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO_ROOT, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout.split() == ["False", "OSError", "NOT_FOUND"], out.stderr
    leftovers = [f for _, _, files in os.walk(tmp_path) for f in files]
    assert leftovers == []


# ---- the budget over a directory several instances write ------------------------------------


def _bytes_of(directory, suffix=".kvc"):
    return sum(os.path.getsize(os.path.join(d, name)) for d, _, names in os.walk(directory)
               for name in names if name.endswith(suffix))


def test_instances_sharing_a_directory_keep_its_budget_together(make_tier, tmp_path):
    file_bytes = os.path.getsize(_stored_path(make_tier(tmp_path / "probe"), 0))
    budget = 10 * file_bytes
    first, second = (make_tier(tmp_path / "cache", max_bytes=budget) for _ in range(2))
    for n in range(9):
        assert tier_store(first, n) and tier_store(second, 100 + n)
        # Each instance rescans after adding a twentieth of the budget (here: every store).
        assert _bytes_of(first.directory) <= budget
    assert _bytes_of(first.directory) >= 8 * file_bytes  # evicted down to 90%, not below


def test_other_instances_files_are_seen_once_the_last_scan_is_old(make_tier, tmp_path,
                                                                   monkeypatch):
    file_bytes = os.path.getsize(_stored_path(make_tier(tmp_path / "probe"), 0))
    tier = make_tier(tmp_path / "cache", max_bytes=100 * file_bytes)
    other = make_tier(tmp_path / "cache")  # no budget of its own
    for n in range(120):
        assert tier_store(other, 100 + n)
    monkeypatch.setattr("kvtier.offload.tiers.fs._RESCAN_S", 0.0)
    assert tier_store(tier, 1)  # a store, however small, after the interval scans
    assert _bytes_of(tier.directory) == 90 * file_bytes
    assert tier.lookup(key(1)) is LookupResult.FOUND  # the most recent file stays


# ---- temp files left by writers killed mid-write ---------------------------------------------


def _dead_pid():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait(timeout=60)
    return child.pid


def test_temp_files_of_dead_writers_are_removed_and_live_ones_counted(make_tier, tmp_path):
    from kvtier.offload.safe_dir import _HOST

    tier = make_tier(tmp_path, max_bytes=1000 * 166)
    assert tier_store(tier, 1)
    subdir = os.path.dirname(tier.path_for(key(1)))
    dead, live = f"ab.kvc.{_HOST}.{_dead_pid()}.7.tmp", f"cd.kvc.{_HOST}.{os.getpid()}.7.tmp"
    foreign, old = "ef.kvc.otherhost.1.7.tmp", "12.kvc.99.7.tmp"  # another host; old format
    for name in (dead, live, foreign, old):
        with open(os.path.join(subdir, name), "wb") as f:
            f.write(bytes(1000))
    os.utime(os.path.join(subdir, old), (1000, 1000))  # long abandoned, whoever wrote it
    restarted = make_tier(tmp_path, max_bytes=1000 * 166)
    assert tier_store(restarted, 2)  # after the start-up scan
    assert sorted(name for name in os.listdir(subdir) if name.endswith(".tmp")) == \
        sorted([live, foreign])
    assert restarted._used_bytes == 2 * 166 + 2 * 1000
