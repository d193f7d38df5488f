"""The fs tier: one file per chunk under `root_dir`, shared by every instance that mounts it.

Files are content-addressed (`<root>/<namespace>/<aa>/<sha256(key)>.kvc`, in the checked format
of offload/chunk_format.py), so instances with the same KV identity share a cache and others
never see each other's files; `<root>/<namespace>/<namespace>.json` says what the namespace
covers (written with the first chunk, for operators). Writes go to a temp
file that is renamed into place, so a reader sees a whole file or none, and concurrent writers
of one chunk (threads or processes) simply race to rename identical bytes. Lookups never touch
the file system on the caller's (the engine's) thread, where a stat on a hung mount would stall
every request: they answer from memory or through a probe thread (tiers/fs_index.py). Reads and
writes run on the thread pools of `ThreadedTier`. The byte
budget is kept by deleting the least recently used files (mtime, which loads bump), scanned on
the write pool: other instances fill the directory too, and only a scan sees their files, so
each instance scans again once it has added a twentieth of the budget, or at a store a minute
after its last scan. One instance's private overflow is cheaper in the disk tier
(tiers/disk.py).

The directory may be shared with others. The root is resolved once at start-up (a root that is
a symlink to a real directory is normal); below it nothing is read, written or deleted through a
symlink (offload/safe_dir.py). A read-only directory (a read-only mount, or one this user may
not write) is a read-only tier: lookups and loads work, stores are skipped and counted. A full
disk evicts the namespace's least recently used tenth and the store is tried once more. A
namespace directory removed at run time is made again by the next store.

A file that is not this key's chunk (damaged, truncated, another key's) fails its load and is
deleted, so that the next store writes a good copy. One that is intact but fails this
instance's MAC check (written with another chunk secret, or none) is a miss and stays: one
misconfigured instance must not wipe the directory the others share.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import os
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from kvtier.common.options import require
from kvtier.common.sizes import parse_size
from kvtier.offload.chunk_format import (
    FORMAT_NAME,
    ChunkFormatError,
    drop_bad_file,
    file_size,
    is_foreign_chunk,
    read_chunk_into,
    write_chunk,
    write_description,
)
from kvtier.offload.keys import ChunkKey, key_digest, make_chunk_key
from kvtier.offload.safe_dir import (
    DIR_MODE,
    SymlinkRefusedError,
    is_regular_file,
    open_dir,
    open_regular_file,
    opened_dir,
    unlink_quietly,
    write_atomically,
)
from kvtier.offload.tiers.base import LookupResult, TierContext, TransferJob
from kvtier.offload.tiers.fs_index import FsIndex
from kvtier.offload.tiers.fs_scan import CHUNK_SUFFIX, DirectoryScan, scan_directory
from kvtier.offload.tiers.threaded import StoreSkipped, ThreadedTier, check_thread_options

logger = logging.getLogger(__name__)

# After an eviction pass the directory is brought down to this share of the budget (or, on a
# full disk, of what it holds), so that passes (a directory scan each) are rare.
_EVICT_TO = 0.9
# A store scans the directory again once this instance has added this share of the budget
# since its last scan, so N instances sharing it hold at most (1 + N * share) times the budget
# (plus the temp files of writes in progress), at a scan per twentieth of the budget written.
_RESCAN_SHARE = 0.05
# A store also scans once the last scan is this old, so that the gauge follows the other
# instances' writes. Rarely: a scan is a stat per file (200k files for 1 TiB of 5 MiB chunks).
_RESCAN_S = 60.0
# The longest block hash (sha256); xxh3_128's are 16 bytes. Sizes the largest chunk file.
_MAX_BLOCK_HASH_BYTES = 32
# A write that fails with one of these means the directory is read-only for this process.
_READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# A full disk is logged at most this often.
_FULL_LOG_INTERVAL_S = 60.0
# Seconds shutdown waits for the probe thread: it is idle or stuck in a stat on a hung mount.
_PROBE_SHUTDOWN_S = 0.5


class FsTierSetupError(ValueError):
    """The fs tier's directory cannot be used (the message says why and what to do)."""


@dataclass(frozen=True)
class FsTierOptions:
    root_dir: str
    # Byte budget for this namespace's files; None: no limit (the disk's size is the limit).
    max_bytes: int | str | None = None
    num_read_threads: int = 2
    num_write_threads: int = 2
    # Niceness added to the write threads (Linux; elsewhere ignored), see ThreadedTier.
    write_nice: int = 10

    def __post_init__(self) -> None:
        require(isinstance(self.root_dir, str) and self.root_dir != "", "fs.root_dir",
                "must be a directory path", self.root_dir)
        if self.max_bytes is not None:
            object.__setattr__(self, "max_bytes", parse_size(self.max_bytes, "fs.max_bytes"))
            require(self.max_bytes > 0, "fs.max_bytes", "must be > 0", self.max_bytes)
        check_thread_options(self, "fs")


class FsTier(ThreadedTier):
    options_cls: ClassVar[type] = FsTierOptions

    def __init__(self, options: FsTierOptions, context: TierContext) -> None:
        _check_budget(options, context)
        super().__init__(options, context)
        self.root = os.path.realpath(options.root_dir)
        self.directory = os.path.join(self.root, context.namespace.hex())
        self._secret = context.chunk_secret
        self._evict_lock = threading.Lock()
        self._described = False
        self.read_only = self._open_directory()
        self._index = FsIndex(self._is_chunk_file, f"kvtier-{context.name}-probe",
                              f"{context.name} ({self.directory})")
        self._last_full_log: float | None = None
        self._warned_symlink = False
        # Bytes in the namespace's directory (all instances'): the last scan's count plus what
        # this instance added since.
        self._used_bytes = 0
        self._added_since_scan = 0
        self._last_scan = time.monotonic()
        self._scanned = threading.Event()
        labels = {"tier": context.name}
        metrics = context.metrics
        self._used_gauge = None if metrics is None else metrics.gauge(
            "kvtier:offload_fs_used_bytes", "Bytes of chunk files in the fs tier's directory",
            ["tier"]).labels(**labels)
        self._evictions = None if metrics is None else metrics.counter(
            "kvtier:offload_fs_evictions", "Chunk files deleted to keep the fs byte budget or "
            "to make room on a full disk", ["tier"]).labels(**labels)
        # The first job of the write pool: the gauge shows what the directory holds from
        # start-up, without a scan of a large directory delaying it.
        self._writers.submit(self._count_used)

    def _open_directory(self) -> bool:
        """Create the root and namespace directories (0700) unless read-only; True if the
        directory is read-only for this process. A symlinked namespace directory is refused."""
        try:
            os.makedirs(self.root, DIR_MODE, exist_ok=True)
        except OSError as exc:
            if not os.path.isdir(self.root):
                raise FsTierSetupError(f"cannot create the fs tier's directory {self.root}: "
                                       f"{exc.strerror}; choose a directory this user can "
                                       f"create or read") from exc
        read_only = bool(os.statvfs(self.root).f_flag & os.ST_RDONLY) or \
            not os.access(self.root, os.W_OK | os.X_OK)
        try:
            self._make_directory(create=not read_only)
        except SymlinkRefusedError as exc:
            raise FsTierSetupError(f"the fs tier's namespace directory {self.directory} is a "
                                   f"symlink or not a directory; remove it (the tier never "
                                   f"writes through a symlink)") from exc
        except FileNotFoundError:
            pass  # read-only and empty: every lookup misses
        except OSError as exc:
            if exc.errno not in _READ_ONLY_ERRNOS:
                raise FsTierSetupError(f"cannot open the fs tier's directory {self.directory}: "
                                       f"{exc.strerror}") from exc
            read_only = True
        if read_only:
            logger.warning("fs tier %s: %s is read-only; its chunks are loaded, stores are "
                           "skipped", self.context.name, self.root)
        return read_only

    def _make_directory(self, create: bool = True) -> None:
        """Open the namespace directory, creating it (0700) when missing with `create`; never
        through a symlink at either level."""
        with opened_dir(self.root) as root_fd, \
                opened_dir(os.path.basename(self.directory), root_fd, create):
            pass

    def path_for(self, key: ChunkKey) -> str:
        return self._path(key_digest(key))

    def _path(self, digest: str) -> str:
        return os.path.join(self.directory, digest[:2], digest + CHUNK_SUFFIX)

    def lookup(self, key: ChunkKey, req_context: Any = None) -> LookupResult:
        # Existence only: a damaged file fails its load (a counted error) and is dropped then; an
        # intact one with another secret's MAC (or none) fails it and is kept.
        return self._index.lookup(key_digest(key))

    def _is_chunk_file(self, digest: str) -> bool:
        """Whether the chunk file named `digest` is there (on the probe thread: may hang)."""
        try:
            st = os.stat(self._path(digest), follow_symlinks=False)
        except OSError:
            return False
        return stat.S_ISREG(st.st_mode)

    @contextlib.contextmanager
    def _subdir(self, name: str, create: bool = False) -> Iterator[int]:
        """A descriptor of the namespace's subdirectory `name`, opened without following a
        symlink at either level; with `create`, the directories removed since start-up are
        made again (logged)."""
        try:
            ns_fd = open_dir(self.directory)
        except FileNotFoundError:
            if not create:
                raise
            self._recreate_directory()
            ns_fd = open_dir(self.directory)
        try:
            with opened_dir(name, ns_fd, create) as fd:
                yield fd
        finally:
            os.close(ns_fd)

    def _recreate_directory(self) -> None:
        logger.warning("fs tier %s: %s was removed; making it again", self.context.name,
                       self.directory)
        os.makedirs(self.root, DIR_MODE, exist_ok=True)
        self._make_directory()
        self._described = False  # its description went with it
        self._index.clear()  # and its files
        self._last_scan = -math.inf  # and what it held: count afresh at the next store

    def _store(self, job: TransferJob) -> None:
        if self.read_only:
            raise StoreSkipped("read_only")
        self._index.check_available()  # a write would hang in the mount too
        # A file written before the start-up scan ends would be counted twice.
        if not self._scanned.wait(max(0.0, job.deadline - time.monotonic())):
            raise TimeoutError(f"the start-up scan of {self.directory} has not ended")
        try:
            added = self._write(job)
        except OSError as exc:
            if exc.errno in _READ_ONLY_ERRNOS:
                self._become_read_only(exc)
                raise StoreSkipped("read_only") from exc
            if exc.errno not in _FULL_ERRNOS:
                raise
            self._make_room(exc)
            added = self._write(job)  # once: a second failure fails the job
        self._index.remember(key_digest(job.key), True)
        self._account(added)

    def _write(self, job: TransferJob) -> int:
        """Write the job's chunk file; the bytes it added (0: the same chunk was there)."""
        digest = key_digest(job.key)
        name = digest + CHUNK_SUFFIX
        with self._subdir(digest[:2], create=True) as dir_fd:
            if is_regular_file(name, dir_fd):
                # Content-addressed: the same bytes are there already; mark them used.
                with contextlib.suppress(OSError):
                    os.utime(name, dir_fd=dir_fd, follow_symlinks=False)
                return 0
            if not self._described and self.context.description is not None:
                write_description(self.directory, self.context.namespace,
                                  {**self.context.description, "format": FORMAT_NAME})
                self._described = True  # racing write threads write the same file: harmless
            write_atomically(name, dir_fd,
                             lambda f: write_chunk(f, job.key, job.buffer, self._secret))
        return file_size(job.key, len(job.buffer), self._secret)

    def _load(self, job: TransferJob) -> None:
        self._index.check_available()  # a read would hang in the mount too
        digest = key_digest(job.key)
        try:
            self._read(job, digest)
        except Exception:
            self._index.remember(digest, False)  # missing, damaged (dropped) or unreadable
            raise
        self._index.remember(digest, True)

    def _read(self, job: TransferJob, digest: str) -> None:
        name = digest + CHUNK_SUFFIX
        with self._subdir(digest[:2]) as dir_fd, \
                os.fdopen(open_regular_file(name, dir_fd), "rb") as f:
            try:
                read_chunk_into(f, job.key, job.buffer, self._secret)
            except ChunkFormatError:
                f.seek(0)
                if not is_foreign_chunk(f, job.key, job.buffer, self._secret):
                    drop_bad_file(f, name, dir_fd)  # so that a later store writes a good copy
                raise
            # The access time the budget's LRU eviction goes by; a read-only directory keeps
            # the old one.
            with contextlib.suppress(OSError):
                os.utime(f.fileno())

    def _become_read_only(self, exc: OSError) -> None:
        if not self.read_only:
            self.read_only = True
            logger.warning("fs tier %s: a write in %s failed (%s); the tier is read-only from "
                           "now on: its chunks are loaded, stores are skipped",
                           self.context.name, self.directory, exc.strerror)

    def _make_room(self, exc: OSError) -> None:
        """The disk is full: delete the least recently used tenth of the namespace's files."""
        now = time.monotonic()
        if self._last_full_log is None or now - self._last_full_log > _FULL_LOG_INTERVAL_S:
            self._last_full_log = now
            logger.warning("fs tier %s: %s (%s); evicting this namespace's least recently used "
                           "chunks (set a byte budget, fs=DIR:SIZE, to keep below it)",
                           self.context.name, exc.strerror, self.directory)
        with self._evict_lock:
            scan = self._scan()
            self._used_bytes = self._evict_down_to(scan, int(scan.used_bytes * _EVICT_TO))
            self._set_gauge()

    def _count_used(self) -> None:
        with self._evict_lock:
            self._used_bytes = self._scan().used_bytes
        self._scanned.set()
        self._account(0)

    def _account(self, added: int) -> None:
        """Count the `added` bytes of a store; scan again when due (see _RESCAN_SHARE) and evict
        down to _EVICT_TO of the budget when over it."""
        budget = self.options.max_bytes
        with self._evict_lock:
            self._used_bytes += added
            self._added_since_scan += added
            if budget is not None and (
                    self._used_bytes > budget
                    or self._added_since_scan >= budget * _RESCAN_SHARE
                    or time.monotonic() - self._last_scan >= _RESCAN_S):
                scan = self._scan()
                self._used_bytes = scan.used_bytes
                if self._used_bytes > budget:
                    self._used_bytes = self._evict_down_to(scan, int(budget * _EVICT_TO))
            self._set_gauge()

    def _set_gauge(self) -> None:
        if self._used_gauge is not None:
            self._used_gauge.set(self._used_bytes)

    def _evict_down_to(self, scan: DirectoryScan, target: int) -> int:
        """Delete the least recently used chunk files until the directory holds `target` bytes;
        the bytes it holds then."""
        used = scan.used_bytes
        for file in sorted(scan.files, key=lambda file: file.mtime):
            if used <= target:
                break
            if self._delete(file.sub, file.name):
                used -= file.size
                if self._evictions is not None:
                    self._evictions.inc()
        return used

    def _delete(self, sub: str, name: str) -> bool:
        try:
            with self._subdir(sub) as dir_fd:
                deleted = unlink_quietly(name, dir_fd)
        except OSError:
            return False
        if deleted:
            self._index.remember(name.removesuffix(CHUNK_SUFFIX), False)
        return deleted

    def _scan(self) -> DirectoryScan:
        """Every instance's files in the namespace directory (under the eviction lock)."""
        scan = scan_directory(self.directory, self._warn_symlink)
        self._last_scan = time.monotonic()
        self._added_since_scan = 0
        if scan.num_removed_temps:
            logger.info("fs tier %s: removed %d temp file(s) (%d bytes) in %s left by writers "
                        "that died mid-write", self.context.name, scan.num_removed_temps,
                        scan.removed_temp_bytes, self.directory)
        return scan

    def shutdown(self) -> bool:
        probe_stopped = self._index.shutdown(_PROBE_SHUTDOWN_S)
        return super().shutdown() and probe_stopped

    def _warn_symlink(self, name: str) -> None:
        if not self._warned_symlink:
            self._warned_symlink = True
            logger.warning("fs tier %s: %s in %s is a symlink; the tier never reads, writes or "
                           "deletes through it (remove it)", self.context.name, name,
                           self.directory)


def _check_budget(options: FsTierOptions, context: TierContext) -> None:
    """Refuse a budget under which an eviction pass keeps no chunk file."""
    if options.max_bytes is None or context.max_chunk_bytes is None:
        return
    key = make_chunk_key(context.namespace, 0, bytes(_MAX_BLOCK_HASH_BYTES))
    largest = file_size(key, context.max_chunk_bytes, context.chunk_secret)
    if options.max_bytes * _EVICT_TO < largest:
        raise ValueError(f"fs.max_bytes={options.max_bytes} holds no chunk: a chunk file takes "
                         f"up to {largest} bytes and eviction keeps {_EVICT_TO:.0%} of the "
                         f"budget, so it must be at least {math.ceil(largest / _EVICT_TO)} "
                         f"bytes, e.g. fs=DIR:20GiB")
