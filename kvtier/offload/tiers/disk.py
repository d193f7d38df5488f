"""The disk tier: one instance's chunks in the slots of one preallocated file on a local disk.

A store rewrites a slot in place: no file to create, name, allocate and delete per chunk, which
is what the fs tier pays (on the VM of docs/benchmarks.md, 0.12 ms of machine CPU per 372 KB
chunk written into a preallocated file against 0.27 ms for a file per chunk). The price is
sharing: the file belongs to one instance (an exclusive lock); a cache several instances use
is the fs tier's job.

File `<root_dir>/<namespace hex>.kvslots`, little endian, with `<namespace hex>.json` beside it
saying what the namespace covers (for operators):

    file header (4 KiB): magic b"KVTD", format version u16, flags u16 (0), slot stride u64
    slot i at 4 KiB + i * stride:
        slot header (4 KiB): the chunk header, key and MAC (with a chunk secret) of
            offload/chunk_format.py at its start, the store sequence number (u64) in its last
            8 bytes
        payload: the chunk in the standard host layout

The index (key -> slot, least recently used first) is kept in memory and rebuilt at start-up
from the slot headers, in store order, so the cache survives restarts; a slot whose header was
written but is damaged (or, with a chunk secret, carries no MAC) is left out, logged and counted
as a tier error. A slot whose header, key, length, checksum or MAC does not match is a miss,
never data: a store torn by a crash fails its checksum at load and the slot is reused. A file of
another stride is started afresh.

The root directory is resolved once at start-up (a symlink to a real directory is normal) and
the slot file is opened without following a symlink: one planted in its place is refused, never
truncated or grown. The file is created 0600 in a 0700 directory.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import os
import stat
import struct
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from kvtier.common.options import require
from kvtier.common.sizes import parse_size
from kvtier.offload.chunk_format import (
    FORMAT_NAME,
    HEADER_BYTES,
    MAC_BYTES,
    ChunkFormatError,
    check_header,
    check_payload,
    decode_header,
    encode_header,
    write_description,
)
from kvtier.offload.keys import ChunkKey
from kvtier.offload.safe_dir import DIR_MODE, FILE_MODE
from kvtier.offload.tiers.base import LookupResult, TierContext, TransferJob
from kvtier.offload.tiers.threaded import ThreadedTier, check_thread_options

logger = logging.getLogger(__name__)

FILE_MAGIC = b"KVTD"
FORMAT_VERSION = 2
_FILE_HEADER = struct.Struct("<4sHHQ")
_SEQUENCE = struct.Struct("<Q")
_PAGE = 4096  # the file header and each slot header take one page; payloads start page-aligned
_SEQUENCE_AT = _PAGE - _SEQUENCE.size
_MAX_KEY_BYTES = _SEQUENCE_AT - HEADER_BYTES - MAC_BYTES
_SUFFIX = ".kvslots"


class DiskTierError(Exception):
    """A slot does not hold the chunk asked for (evicted, damaged, or never stored)."""


class DiskTierSetupError(ValueError):
    """The slot file cannot be opened, locked or reserved at start-up (the message says why)."""


class DiskTierInUseError(DiskTierSetupError):
    """Another process (or tier) holds the slot file."""


@dataclass(frozen=True)
class DiskTierOptions:
    root_dir: str
    # Size of the slot file, preallocated at start-up; it holds max_bytes // stride chunks.
    max_bytes: int | str
    num_read_threads: int = 2
    num_write_threads: int = 2
    # Niceness added to the write threads (Linux; elsewhere ignored), see ThreadedTier.
    write_nice: int = 10

    def __post_init__(self) -> None:
        require(isinstance(self.root_dir, str) and self.root_dir != "", "disk.root_dir",
                "must be a directory path", self.root_dir)
        object.__setattr__(self, "max_bytes", parse_size(self.max_bytes, "disk.max_bytes"))
        require(self.max_bytes > 0, "disk.max_bytes", "must be > 0", self.max_bytes)
        check_thread_options(self, "disk")


# The file's own header; the slots follow it.
FILE_HEADER_BYTES = _PAGE


def slot_stride(max_chunk_bytes: int) -> int:
    """Bytes one slot takes in the file: a header page, then the chunk in whole pages."""
    return _PAGE + _round_up(max_chunk_bytes, _PAGE)


class DiskTier(ThreadedTier):
    options_cls: ClassVar[type] = DiskTierOptions

    def __init__(self, options: DiskTierOptions, context: TierContext) -> None:
        if context.max_chunk_bytes is None:
            raise ValueError("the disk tier needs TierContext.max_chunk_bytes to size its slots")
        self.stride = slot_stride(context.max_chunk_bytes)
        self.num_slots = (options.max_bytes - FILE_HEADER_BYTES) // self.stride
        if self.num_slots < 1:
            raise ValueError(f"disk.max_bytes={options.max_bytes} holds no chunk; it must be at "
                             f"least {_PAGE + self.stride} bytes (one {self.stride}-byte slot)")
        self.root = os.path.realpath(options.root_dir)
        self.path = os.path.join(self.root, context.namespace.hex() + _SUFFIX)
        self._secret = context.chunk_secret
        try:
            os.makedirs(self.root, DIR_MODE, exist_ok=True)
        except OSError as exc:
            raise DiskTierSetupError(f"cannot create the disk tier's directory "
                                     f"{self.root}: {exc.strerror}; choose a writable "
                                     f"directory") from exc
        self._fd = _open_locked(self.path)
        try:
            self._prepare_file()
            entries, num_damaged = self._read_slot_headers(context.namespace)
        except BaseException:
            os.close(self._fd)
            raise
        if num_damaged:
            _report_damaged(context, self.path, num_damaged)
        if context.description is not None:
            write_description(self.root, context.namespace,
                              {**context.description, "format": f"KVTD/{FORMAT_VERSION} slots of "
                                                                 f"{FORMAT_NAME} chunks"})
        super().__init__(options, context)
        self._lock = threading.Lock()
        self._index: OrderedDict[ChunkKey, int] = OrderedDict()  # least recently used first
        for _, key, slot in sorted(entries):
            self._index[key] = slot
        used = set(self._index.values())
        self._free = [slot for slot in reversed(range(self.num_slots)) if slot not in used]
        self._readers_of: dict[int, int] = {}  # slot -> loads reading it now
        self._orphans: set[int] = set()  # slots dropped from the index while being read
        # Overwritten since the last take_evicted; bounded, as nobody may be taking them.
        self._evicted: deque[ChunkKey] = deque(maxlen=self.num_slots)
        self._sequence = itertools.count(max((seq for seq, _, _ in entries), default=0) + 1)
        labels = {"tier": context.name}
        metrics = context.metrics
        self._used_gauge = None if metrics is None else metrics.gauge(
            "kvtier:offload_disk_used_bytes", "Bytes of the disk tier's slots holding a chunk",
            ["tier"]).labels(**labels)
        self._evictions = None if metrics is None else metrics.counter(
            "kvtier:offload_disk_evictions", "Chunks overwritten to make room in the disk tier",
            ["tier"]).labels(**labels)
        self._set_used_gauge()

    def lookup(self, key: ChunkKey, req_context: Any = None) -> LookupResult:
        with self._lock:
            return LookupResult.FOUND if key in self._index else LookupResult.NOT_FOUND

    def take_evicted(self) -> list[ChunkKey]:
        with self._lock:
            evicted = list(self._evicted)
            self._evicted.clear()
        return evicted

    def shutdown(self) -> bool:
        stopped = super().shutdown()
        # A thread stuck in I/O keeps the file: closed, its number could be reused by another
        # file the stuck write would then land in. The process's exit closes it.
        if stopped:
            os.close(self._fd)  # releases the lock
        return stopped

    def _store(self, job: TransferJob) -> None:
        if len(job.buffer) > self.stride - _PAGE:
            raise ValueError(f"chunk of {len(job.buffer)} bytes exceeds the slot's "
                             f"{self.stride - _PAGE}")
        if len(job.key) > _MAX_KEY_BYTES:
            raise ValueError(f"key of {len(job.key)} bytes exceeds the slot header's "
                             f"{_MAX_KEY_BYTES}")
        with self._lock:
            if job.key in self._index:
                self._index.move_to_end(job.key)
                return
            slot = self._take_slot()
            sequence = next(self._sequence)
        try:
            header = bytearray(_PAGE)
            chunk_header = encode_header(job.key, job.buffer, self._secret)
            header[:len(chunk_header)] = chunk_header
            _SEQUENCE.pack_into(header, _SEQUENCE_AT, sequence)
            _pwrite_all(self._fd, [header, job.buffer], self._offset(slot))
        except BaseException:
            with self._lock:
                self._free.append(slot)
            raise
        with self._lock:
            if job.key in self._index:  # another write thread stored it meanwhile
                self._free.append(slot)
            else:
                self._index[job.key] = slot
            self._set_used_gauge()

    def _load(self, job: TransferJob) -> None:
        with self._lock:
            slot = self._index.get(job.key)
            if slot is None:
                raise DiskTierError("chunk not in the disk tier (overwritten since its lookup)")
            self._index.move_to_end(job.key)
            self._readers_of[slot] = self._readers_of.get(slot, 0) + 1
        problem = None
        try:
            header = bytearray(_PAGE)
            _pread_all(self._fd, [header, job.buffer], self._offset(slot))
            problem = _slot_problem(header, job.key, job.buffer, self._secret)
        finally:
            with self._lock:
                if problem is not None and self._index.get(job.key) == slot:
                    del self._index[job.key]  # a bad slot: free it once no load reads it
                    self._orphans.add(slot)
                    self._set_used_gauge()
                self._readers_of[slot] -= 1
                if not self._readers_of[slot]:
                    del self._readers_of[slot]
                    if slot in self._orphans:
                        self._orphans.discard(slot)
                        self._free.append(slot)
        if problem is not None:
            raise DiskTierError(f"slot {slot}: {problem}")

    def _take_slot(self) -> int:
        """A slot to write into; the least recently used chunk not being read gives way."""
        if self._free:
            return self._free.pop()
        for key, slot in self._index.items():
            if slot not in self._readers_of:
                del self._index[key]
                self._evicted.append(key)
                if self._evictions is not None:
                    self._evictions.inc()
                return slot
        raise DiskTierError("no slot to write into: every slot is being read")

    def _offset(self, slot: int) -> int:
        return _PAGE + slot * self.stride

    def _set_used_gauge(self) -> None:
        if self._used_gauge is not None:
            self._used_gauge.set(len(self._index) * self.stride)

    def _prepare_file(self) -> None:
        """Make the file the configured size, with this stride's header; its space reserved."""
        size = _PAGE + self.num_slots * self.stride
        header = _FILE_HEADER.pack(FILE_MAGIC, FORMAT_VERSION, 0, self.stride)
        if os.pread(self._fd, _FILE_HEADER.size, 0) != header:
            os.ftruncate(self._fd, 0)  # new, or of another format or stride: start afresh
            _pwrite_all(self._fd, [header], 0)
        try:
            if os.fstat(self._fd).st_size != size:
                os.ftruncate(self._fd, size)  # a smaller budget drops the slots past its end
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:
            raise DiskTierSetupError(f"cannot reserve {size} bytes for the disk tier in "
                                     f"{self.path}: {exc.strerror}; lower its size or free "
                                     f"space") from exc

    def _read_slot_headers(self, namespace: bytes) -> tuple[list[tuple[int, ChunkKey, int]],
                                                            int]:
        """(sequence, key, slot) of every slot whose header is whole and of this namespace, and
        the number of written slots whose header is not (never-written slots are zeros)."""
        entries: dict[ChunkKey, tuple[int, ChunkKey, int]] = {}
        num_damaged = 0
        for slot in range(self.num_slots):
            header = os.pread(self._fd, _PAGE, self._offset(slot))
            if len(header) < _PAGE or not any(header):
                continue
            key = self._key_of(header, namespace)
            if key is None:
                num_damaged += 1
                continue
            (sequence,) = _SEQUENCE.unpack_from(header, _SEQUENCE_AT)
            if key not in entries or entries[key][0] < sequence:
                entries[key] = (sequence, key, slot)
        return list(entries.values()), num_damaged

    def _key_of(self, header: bytes, namespace: bytes) -> ChunkKey | None:
        """The key a slot header names, or None if the header is not a whole one of this
        namespace (with a chunk secret: of a chunk with a MAC)."""
        try:
            chunk = decode_header(header)
        except ChunkFormatError:
            return None
        if chunk.key_bytes > _MAX_KEY_BYTES or chunk.payload_bytes > self.stride - _PAGE:
            return None
        if self._secret is not None and not chunk.mac_bytes:
            return None
        key = ChunkKey(header[HEADER_BYTES:HEADER_BYTES + chunk.key_bytes])
        return key if key.startswith(namespace) else None


def _report_damaged(context: TierContext, path: str, num_damaged: int) -> None:
    """Log the slots left out of the index at start-up and count them as tier errors."""
    logger.warning("disk tier %s: %d slot header(s) in %s are damaged (or carry no MAC under "
                   "a chunk secret); those slots are reused", context.name, num_damaged, path)
    if context.metrics is not None:
        context.metrics.counter("kvtier:offload_tier_errors", "Failed tier operations",
                                ["tier"]).labels(tier=context.name).inc(num_damaged)


def _slot_problem(header: bytearray, key: ChunkKey, payload: memoryview,
                  secret: bytes | None) -> str | None:
    """Why the slot just read is not `key`'s chunk, or None when it is."""
    try:
        chunk = decode_header(header)
        key_end = HEADER_BYTES + chunk.key_bytes
        check_header(chunk, bytes(header[HEADER_BYTES:key_end]), key, len(payload), secret)
        check_payload(chunk, payload, secret, bytes(header[:key_end]),
                      bytes(header[key_end:key_end + chunk.mac_bytes]))
    except ChunkFormatError as exc:
        return str(exc)
    return None


def _open_locked(path: str) -> int:
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DiskTierSetupError(f"the disk tier's file {path} is a symlink; refused (it "
                                     f"would write wherever it points): remove it") from None
        raise DiskTierSetupError(f"cannot open the disk tier's file {path}: {exc.strerror}; "
                                 f"choose a writable directory") from exc
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DiskTierSetupError(f"the disk tier's file {path} is not a regular file; remove "
                                 f"it")
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise DiskTierInUseError(
            f"disk tier file {path} is in use by another kvtier instance; give each instance "
            f"its own directory, or share a cache between instances with the fs tier "
            f"(fs=DIR in --kv-offload)") from None
    return fd


def _pwrite_all(fd: int, buffers: Sequence[Any], offset: int) -> None:
    _whole(os.pwritev, fd, buffers, offset, OSError)


def _pread_all(fd: int, buffers: Sequence[Any], offset: int) -> None:
    _whole(os.preadv, fd, buffers, offset, DiskTierError)


def _whole(io: Callable[[int, list[memoryview], int], int], fd: int, buffers: Sequence[Any],
           offset: int, error: type[Exception]) -> None:
    """Repeat a vectored read or write (`io`) until every byte of `buffers` is moved."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        moved = io(fd, views, offset)
        if moved == 0:
            raise error(f"{io.__name__} moved nothing at offset {offset} of the slot file")
        offset += moved
        views = _advance(views, moved)


def _advance(views: list[memoryview], num_bytes: int) -> list[memoryview]:
    """`views` less their first `num_bytes` bytes."""
    while views and num_bytes >= len(views[0]):
        num_bytes -= len(views[0])
        views = views[1:]
    if views and num_bytes:
        views = [views[0][num_bytes:]] + views[1:]
    return views


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
