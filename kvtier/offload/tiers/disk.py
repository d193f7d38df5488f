"""The disk tier: one instance's chunks in the slots of one preallocated file on a local disk.

A store rewrites a slot in place: no file to create, name, allocate and delete per chunk as the
fs tier does (on the VM of docs/benchmarks.md, 0.12 ms of machine CPU per 372 KB chunk written
into a preallocated file, 0.27 ms for a file per chunk). The price is sharing: the file belongs
to one instance (an exclusive lock); a cache several instances use is the fs tier's job.

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

Loads straight from the page cache: the file is also mapped read-only into the process
(slot_file.MappedFile). A chunk whose payload this process has checked (it stored the slot, read
it through a checked load, or checked it at start-up) and whose pages are all in memory is
loaded into the device from the mapping in the step that admits its request, as a host hit is,
instead of being promoted into a host slot first and loaded a step later (`num_mappable`,
`pin_mapped`). Its checksum is not computed again on the way: the file is this instance's alone
(locked), so its bytes change only by this tier's own stores, which take the slot out of the
checked ones first. At start-up a thread checks the indexed slots whose pages are in memory, the
most recently stored first, so that a restart on a warm page cache loads this way at once. Off
with `direct_loads=False`, and with a chunk secret (every load then checks its chunk's MAC).

The root directory is resolved once at start-up (a symlink to a real directory is normal); the
slot file, created 0600 in a 0700 directory, is opened without following a symlink: one planted
in its place is refused, never truncated or grown. The directory's size is the budget: the slot
files of other namespaces no running instance holds are removed at start-up (tiers/slot_dir.py).
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import struct
import threading
from collections import OrderedDict, deque
from collections.abc import Sequence
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
from kvtier.offload.tiers.base import LookupResult, MappedChunk, TierContext, TransferJob
from kvtier.offload.tiers.slot_dir import open_slot_file
from kvtier.offload.tiers.slot_file import (
    DiskTierError,
    DiskTierInUseError,
    DiskTierSetupError,
    MappedFile,
    pread_all,
    pwrite_all,
)
from kvtier.offload.tiers.threaded import ThreadedTier, check_thread_options, lower_priority

logger = logging.getLogger(__name__)

FILE_MAGIC = b"KVTD"
FORMAT_VERSION = 2
_FILE_HEADER = struct.Struct("<4sHHQ")
_SEQUENCE = struct.Struct("<Q")
_PAGE = 4096  # the file header and each slot header take one page; payloads start page-aligned
_SEQUENCE_AT = _PAGE - _SEQUENCE.size
_MAX_KEY_BYTES = _SEQUENCE_AT - HEADER_BYTES - MAC_BYTES
# Seconds shutdown waits for the start-up check's thread (it stops between two slots).
_SHUTDOWN_CHECKER_S = 1.0

__all__ = ["DiskTier", "DiskTierError", "DiskTierInUseError", "DiskTierOptions",
           "DiskTierSetupError", "FILE_HEADER_BYTES", "slot_stride"]


@dataclass(frozen=True)
class DiskTierOptions:
    root_dir: str
    # Size of the slot file, preallocated at start-up; it holds max_bytes // stride chunks.
    max_bytes: int | str
    num_read_threads: int = 2
    num_write_threads: int = 2
    # Niceness added to the write threads (Linux; elsewhere ignored), see ThreadedTier.
    write_nice: int = 10
    # Load checked chunks whose pages are in memory straight from the mapped file.
    direct_loads: bool = True

    def __post_init__(self) -> None:
        require(isinstance(self.root_dir, str) and self.root_dir != "", "disk.root_dir",
                "must be a directory path", self.root_dir)
        object.__setattr__(self, "max_bytes", parse_size(self.max_bytes, "disk.max_bytes"))
        require(self.max_bytes > 0, "disk.max_bytes", "must be > 0", self.max_bytes)
        check_thread_options(self, "disk")
        require(isinstance(self.direct_loads, bool), "disk.direct_loads", "must be true or "
                "false", self.direct_loads)


# The file's own header; the slots follow it.
FILE_HEADER_BYTES = _PAGE


def slot_stride(max_chunk_bytes: int) -> int:
    """Bytes one slot takes in the file: a header page, then the chunk in whole pages."""
    return _PAGE + -(-max_chunk_bytes // _PAGE) * _PAGE


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
        self._secret = context.chunk_secret
        self.path, self._fd = open_slot_file(self.root, context.namespace, context.name)
        try:
            self._prepare_file()
            entries, num_damaged = self._read_slot_headers(context.namespace)
        except BaseException:
            os.close(self._fd)
            raise
        if num_damaged:
            _report_errors(context, f"{num_damaged} slot header(s) in {self.path} are damaged "
                                    f"(or carry no MAC under a chunk secret); those slots are "
                                    f"reused", num_damaged)
        if context.description is not None:
            write_description(self.root, context.namespace,
                              {**context.description, "format": f"KVTD/{FORMAT_VERSION} slots of "
                                                                 f"{FORMAT_NAME} chunks"})
        super().__init__(options, context)
        self._lock = threading.Lock()
        self._index: OrderedDict[ChunkKey, int] = OrderedDict()  # least recently used first
        for _, key, slot, _ in sorted(entries):
            self._index[key] = slot
        used = set(self._index.values())
        self._free = [slot for slot in reversed(range(self.num_slots)) if slot not in used]
        self._readers_of: dict[int, int] = {}  # slot -> loads reading it now
        self._orphans: set[int] = set()  # slots dropped from the index while being read
        # Overwritten or found damaged since the last take_evicted; bounded, as nobody may be
        # taking them.
        self._evicted: deque[ChunkKey] = deque(maxlen=self.num_slots)
        self._sequence = itertools.count(max((seq for seq, _, _, _ in entries), default=0) + 1)
        labels = {"tier": context.name}
        metrics = context.metrics
        self._used_gauge = None if metrics is None else metrics.gauge(
            "kvtier:offload_disk_used_bytes", "Bytes of the disk tier's slots holding a chunk",
            ["tier"]).labels(**labels)
        self._evictions = None if metrics is None else metrics.counter(
            "kvtier:offload_disk_evictions", "Chunks overwritten to make room in the disk tier",
            ["tier"]).labels(**labels)
        self._set_used_gauge()
        # Newest first: the order the start-up check takes them in.
        self._start_direct_loads(options, [entry[1:] for entry in sorted(entries, reverse=True)])

    def _start_direct_loads(self, options: DiskTierOptions,
                            slots: list[tuple[ChunkKey, int, int]]) -> None:
        """Map the file and start checking the resident ones of `slots` (key, slot, payload
        bytes), unless direct loads are off."""
        # slot -> payload bytes of the slots this process has checked (or stored)
        self._checked: dict[int, int] = {}
        self._mapping = MappedFile.open(self._fd, _PAGE + self.num_slots * self.stride) \
            if options.direct_loads and self._secret is None else None
        self._stop = threading.Event()
        self._checker: threading.Thread | None = None
        if self._mapping is not None and slots:
            self._checker = threading.Thread(target=self._check_resident_slots,
                                             args=(slots, options.write_nice), daemon=True,
                                             name=f"kvtier-{self.context.name}-check")
            self._checker.start()

    def lookup(self, key: ChunkKey, req_context: Any = None) -> LookupResult:
        with self._lock:
            if key not in self._index:
                return LookupResult.NOT_FOUND
            # A use: a chunk found is loaded next, and until a read thread takes its load the
            # stores of the same step must overwrite other chunks, not it.
            self._index.move_to_end(key)
            return LookupResult.FOUND

    def take_evicted(self) -> list[ChunkKey]:
        with self._lock:
            evicted = list(self._evicted)
            self._evicted.clear()
        return evicted

    def num_mappable(self, keys: Sequence[ChunkKey], num_bytes: int, in_memory: bool = True) -> int:
        offsets = []  # of the payloads of the leading keys the mapping may serve
        with self._lock:
            for key in keys:
                slot = self._checked_slot(key, num_bytes)
                if slot is None:
                    break
                offsets.append(self._offset(slot) + _PAGE)
        if not (in_memory and offsets):  # (no offsets without a mapping)
            return len(offsets)
        return self._mapping.num_resident(offsets, num_bytes)

    def pin_mapped(self, chunks: Sequence[tuple[ChunkKey, int]]) -> list[MappedChunk | None]:
        pins: list[MappedChunk | None] = []
        with self._lock:
            for key, num_bytes in chunks:
                slot = self._checked_slot(key, num_bytes)
                if slot is not None:
                    self._index.move_to_end(key)
                    self._pin(slot)
                pins.append(None if slot is None else MappedChunk(
                    self, self._mapping, self._offset(slot) + _PAGE, num_bytes, slot))
        return pins

    def _checked_slot(self, key: ChunkKey, num_bytes: int) -> int | None:
        """`key`'s slot if loadable from the mapping (checked, of `num_bytes`); under the lock."""
        slot = self._index.get(key)
        return slot if self._mapping is not None and self._checked.get(slot) == num_bytes else None

    def release_mapped(self, chunk: MappedChunk) -> None:
        with self._lock:
            self._unpin(chunk.pin)

    def shutdown(self) -> bool:
        self._stop.set()
        if self._checker is not None:  # it reads the file: done before the file is closed
            self._checker.join(_SHUTDOWN_CHECKER_S)
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
            self._checked.pop(slot, None)
            sequence = next(self._sequence)
        try:
            header = bytearray(_PAGE)
            chunk_header = encode_header(job.key, job.buffer, self._secret)
            header[:len(chunk_header)] = chunk_header
            _SEQUENCE.pack_into(header, _SEQUENCE_AT, sequence)
            pwrite_all(self._fd, [header, job.buffer], self._offset(slot))
            if self._mapping is not None:  # map its pages now, not in a later load's step
                self._mapping.populate(self._offset(slot) + _PAGE, len(job.buffer))
        except BaseException:
            with self._lock:
                self._free.append(slot)
            raise
        with self._lock:
            if job.key in self._index:  # another write thread stored it meanwhile
                self._free.append(slot)
            else:
                self._index[job.key] = slot
                self._checked[slot] = len(job.buffer)
            self._set_used_gauge()

    def _load(self, job: TransferJob, touch: bool = True) -> None:
        """Read and check the chunk into the job's buffer; `touch`: count it as a use (LRU)."""
        with self._lock:
            slot = self._index.get(job.key)
            if slot is None:
                raise DiskTierError("chunk not in the disk tier (overwritten since its lookup)")
            if touch:
                self._index.move_to_end(job.key)
            self._pin(slot)
        problem, checked = None, False
        try:
            header = bytearray(_PAGE)
            pread_all(self._fd, [header, job.buffer], self._offset(slot))
            problem = _slot_problem(header, job.key, job.buffer, self._secret)
            checked = problem is None
        finally:
            with self._lock:
                if checked:
                    self._checked[slot] = len(job.buffer)
                if problem is not None and self._index.get(job.key) == slot:
                    del self._index[job.key]  # a bad slot: free it once no load reads it
                    self._evicted.append(job.key)  # gone as much as an overwritten one
                    self._checked.pop(slot, None)
                    self._orphans.add(slot)
                    self._set_used_gauge()
                self._unpin(slot)
        if problem is not None:
            raise DiskTierError(f"slot {slot}: {problem}")

    def _pin(self, slot: int) -> None:
        """A load reads `slot` (under the lock): no store overwrites it until `_unpin`."""
        self._readers_of[slot] = self._readers_of.get(slot, 0) + 1

    def _unpin(self, slot: int) -> None:
        """A load no longer reads `slot` (under the lock); a dropped slot is free once none does."""
        self._readers_of[slot] -= 1
        if not self._readers_of[slot]:
            del self._readers_of[slot]
            if slot in self._orphans:
                self._orphans.discard(slot)
                self._free.append(slot)

    def _check_resident_slots(self, slots: list[tuple[ChunkKey, int, int]], nice: int) -> None:
        """Check those of `slots` (key, slot, payload bytes as the start-up scan read them)
        still indexed and in memory, so that their loads take the mapping, and map their pages
        (once, on its own thread, from start-up)."""
        lower_priority(nice)
        payload = memoryview(bytearray(self.stride - _PAGE))
        for key, slot, num_bytes in slots:
            if self._stop.is_set():
                return
            offset = self._offset(slot)
            with self._lock:
                if self._index.get(key) != slot or slot in self._checked:
                    continue
            if not self._mapping.is_resident(offset, _PAGE + num_bytes):
                continue
            try:
                self._load(TransferJob(-1, key, payload[:num_bytes], math.inf), touch=False)
                self._mapping.populate(offset + _PAGE, num_bytes)
            except (DiskTierError, OSError) as exc:
                if self._stop.is_set():
                    return
                _report_errors(self.context, f"{self.path}: {exc}", 1)

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
            pwrite_all(self._fd, [header], 0)
        try:
            if os.fstat(self._fd).st_size != size:
                os.ftruncate(self._fd, size)  # a smaller budget drops the slots past its end
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:
            raise DiskTierSetupError(f"cannot reserve {size} bytes for the disk tier in "
                                     f"{self.path}: {exc.strerror}; lower its size or free "
                                     f"space") from exc

    def _read_slot_headers(self, namespace: bytes) -> tuple[
            list[tuple[int, ChunkKey, int, int]], int]:
        """(sequence, key, slot, payload bytes) of every slot whose header is whole and of this
        namespace, and the number of written slots whose header is not (never-written slots are
        zeros)."""
        entries: dict[ChunkKey, tuple[int, ChunkKey, int, int]] = {}
        num_damaged = 0
        for slot in range(self.num_slots):
            header = os.pread(self._fd, _PAGE, self._offset(slot))
            if len(header) < _PAGE or not any(header):
                continue
            named = self._chunk_of(header, namespace)
            if named is None:
                num_damaged += 1
                continue
            key, payload_bytes = named
            (sequence,) = _SEQUENCE.unpack_from(header, _SEQUENCE_AT)
            if key not in entries or entries[key][0] < sequence:
                entries[key] = (sequence, key, slot, payload_bytes)
        return list(entries.values()), num_damaged

    def _chunk_of(self, header: bytes, namespace: bytes) -> tuple[ChunkKey, int] | None:
        """The key and payload bytes a slot header names, or None if the header is not a whole
        one of this namespace (with a chunk secret: of a chunk with a MAC)."""
        try:
            chunk = decode_header(header)
        except ChunkFormatError:
            return None
        if chunk.key_bytes > _MAX_KEY_BYTES or chunk.payload_bytes > self.stride - _PAGE:
            return None
        if self._secret is not None and not chunk.mac_bytes:
            return None
        key = ChunkKey(header[HEADER_BYTES:HEADER_BYTES + chunk.key_bytes])
        return (key, chunk.payload_bytes) if key.startswith(namespace) else None


def _report_errors(context: TierContext, what: str, count: int) -> None:
    """Log slots found bad outside a job (at start-up) and count them as tier errors."""
    logger.warning("disk tier %s: %s", context.name, what)
    if context.metrics is not None:
        context.metrics.counter("kvtier:offload_tier_errors", "Failed tier operations",
                                ["tier"]).labels(tier=context.name).inc(count)


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

