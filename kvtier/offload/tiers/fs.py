"""The fs tier: one file per chunk under `root_dir`, shared by every instance that mounts it.

Files are content-addressed (`<root>/<namespace>/<aa>/<sha256(key)>.kvc`, in the checked format
of offload/chunk_format.py), so instances with the same KV identity share a cache and others
never see each other's files; `<root>/<namespace>/<namespace>.json` says what the namespace
covers (written with the first chunk, for operators). Writes go to a temp
file that is renamed into place, so a reader sees a whole file or none, and concurrent writers
of one chunk (threads or processes) simply race to rename identical bytes. Lookups are one stat
on the caller's thread; reads and writes run on the thread pools of `ThreadedTier`. The byte
budget is kept by deleting the least recently used files (mtime, which loads bump), scanned on
the write pool. One instance's private overflow is cheaper in the disk tier (tiers/disk.py).
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from typing import Any, ClassVar

from kvtier.common.options import require
from kvtier.common.sizes import parse_size
from kvtier.offload.chunk_format import (
    FORMAT_NAME,
    ChunkFormatError,
    drop_bad_file,
    file_size,
    read_chunk_into,
    write_chunk,
    write_description,
)
from kvtier.offload.keys import ChunkKey, key_digest
from kvtier.offload.tiers.base import LookupResult, TierContext, TransferJob
from kvtier.offload.tiers.threaded import ThreadedTier, check_thread_options

_SUFFIX = ".kvc"
# After an eviction pass the directory is brought down to this share of the budget, so that
# passes (a directory scan each) are rare.
_EVICT_TO = 0.9


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
        super().__init__(options, context)
        self.directory = os.path.join(options.root_dir, context.namespace.hex())
        self._evict_lock = threading.Lock()
        self._described = False
        # Bytes this instance believes are in the directory; None until the first scan.
        self._used_bytes: int | None = None
        labels = {"tier": context.name}
        metrics = context.metrics
        self._used_gauge = None if metrics is None else metrics.gauge(
            "kvtier:offload_fs_used_bytes", "Bytes of chunk files in the fs tier's directory",
            ["tier"]).labels(**labels)
        self._evictions = None if metrics is None else metrics.counter(
            "kvtier:offload_fs_evictions", "Chunk files deleted to keep the fs byte budget",
            ["tier"]).labels(**labels)

    def path_for(self, key: ChunkKey) -> str:
        digest = key_digest(key)
        return os.path.join(self.directory, digest[:2], digest + _SUFFIX)

    def lookup(self, key: ChunkKey, req_context: Any = None) -> LookupResult:
        # Existence only: a damaged file fails its load (a counted error) and is dropped then.
        if os.path.exists(self.path_for(key)):
            return LookupResult.FOUND
        return LookupResult.NOT_FOUND

    def _store(self, job: TransferJob) -> None:
        path = self.path_for(job.key)
        if os.path.exists(path):
            os.utime(path)  # content-addressed: the same bytes are there already
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        if not self._described and self.context.description is not None:
            write_description(self.directory, self.context.namespace,
                              {**self.context.description, "format": FORMAT_NAME})
            self._described = True  # racing write threads both write the same file: harmless
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            with open(tmp, "wb") as f:
                write_chunk(f, job.key, job.buffer)
            os.replace(tmp, path)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        self._account(file_size(job.key, len(job.buffer)))

    def _load(self, job: TransferJob) -> None:
        path = self.path_for(job.key)
        with open(path, "rb") as f:
            try:
                read_chunk_into(f, job.key, job.buffer)
            except ChunkFormatError:
                drop_bad_file(f, path)
                raise
        os.utime(path)  # the access time the budget's LRU eviction goes by

    def _account(self, added: int) -> None:
        budget = self.options.max_bytes
        with self._evict_lock:
            if self._used_bytes is None:
                self._used_bytes = sum(size for _, size, _ in self._scan())
            else:
                self._used_bytes += added
            if budget is not None and self._used_bytes > budget:
                self._used_bytes = self._evict_down_to(int(budget * _EVICT_TO))
            if self._used_gauge is not None:
                self._used_gauge.set(self._used_bytes)

    def _evict_down_to(self, target: int) -> int:
        files = sorted(self._scan(), key=lambda entry: entry[2])  # oldest access first
        used = sum(size for _, size, _ in files)
        for path, size, _ in files:
            if used <= target:
                break
            if _unlink_quietly(path):
                used -= size
                if self._evictions is not None:
                    self._evictions.inc()
        return used

    def _scan(self) -> list[tuple[str, int, float]]:
        """(path, size, mtime) of every chunk file of this namespace, across all instances."""
        found = []
        for sub in _listdir(self.directory):
            subdir = os.path.join(self.directory, sub)
            for name in _listdir(subdir):
                if not name.endswith(_SUFFIX):
                    continue
                path = os.path.join(subdir, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue  # deleted by another instance meanwhile
                found.append((path, st.st_size, st.st_mtime))
        return found


def _listdir(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:
        return []


def _unlink_quietly(path: str) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False
