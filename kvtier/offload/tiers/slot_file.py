"""The disk tier's file: opened once under an exclusive lock, read and written whole with
vectored calls, and mapped read-only into the process so that a chunk the page cache holds can
be loaded into the device straight from there (`MappedFile`).

A read through the mapping of a page that is not in memory faults it in from the disk, and an
I/O error there is a SIGBUS for the whole process, not an exception. So a chunk is only taken
from the mapping when `mincore` says every page of it is in memory, at the lookup in the step
that copies it; what is left is a page the kernel reclaims in the few milliseconds between that
check and the copy, read back inside the copy (an I/O error then is the SIGBUS). Checking again
right before the copy would cost as much as the check (~1.3 ms for an 8k-token prompt) for a
window of about the same length as the copy itself. The tier fills the page table entries of the
chunks it writes or checks ahead (MADV_POPULATE_READ, which reports an I/O error as an error), so
that neither the check nor the copy faults them in: `mincore` over a 368 KB chunk takes ~2.5 us
with its entries filled, ~9 us without, on the VM of docs/benchmarks.md.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import stat
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch

from kvtier.common.libc import load_libc
from kvtier.offload.safe_dir import FILE_MODE, names_file

_MADV_POPULATE_READ = 22  # Linux 5.14+ <sys/mman.h>
# mincore's answer per page: bit 0 says resident, the other bits are reserved.
_RESIDENT_BIT = bytes(value & 1 for value in range(256))
# Opens of the slot file `open_locked` tries, each losing it to a removal between open and lock.
_OPEN_TRIES = 3


class DiskTierError(Exception):
    """A slot does not hold the chunk asked for (evicted, damaged, or never stored)."""


class DiskTierSetupError(ValueError):
    """The slot file cannot be opened, locked or reserved at start-up (the message says why)."""


class DiskTierInUseError(DiskTierSetupError):
    """Another process (or tier) holds the slot file."""


class MappedFile:
    """A file mapped read-only (shared: it shows what the file holds now) into the process."""

    def __init__(self, fd: int, num_bytes: int) -> None:
        # Through a descriptor of its own: a mapping keeps its open file alive, and with it a
        # `flock` on that file, which must end when the owner closes `fd`.
        own = os.open(f"/proc/self/fd/{fd}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            self._map = mmap.mmap(own, num_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(own)
        self.array = np.frombuffer(self._map, dtype=np.uint8)
        self._address = self.array.ctypes.data
        self._mincore = load_libc().mincore
        with warnings.catch_warnings():  # read-only memory: nothing here ever writes to it
            warnings.simplefilter("ignore", UserWarning)
            self.tensor = torch.frombuffer(self._map, dtype=torch.uint8)

    @classmethod
    def open(cls, fd: int, num_bytes: int) -> MappedFile | None:
        """The mapping, or None where residency cannot be checked (not Linux, no mincore)."""
        libc = load_libc()
        if not sys.platform.startswith("linux") or libc is None or not hasattr(libc, "mincore"):
            return None
        try:
            return cls(fd, num_bytes)
        except (OSError, ValueError):
            return None

    def num_resident(self, offsets: Sequence[int], num_bytes: int) -> int:
        """How many of the ranges [offset, offset + num_bytes) of `offsets`, from the first,
        have every page in memory (page-aligned offsets)."""
        vector = (ctypes.c_ubyte * -(-num_bytes // mmap.PAGESIZE))()
        for index, offset in enumerate(offsets):
            if (self._mincore(ctypes.c_void_p(self._address + offset), num_bytes, vector) != 0
                    or b"\x00" in bytes(vector).translate(_RESIDENT_BIT)):
                return index
        return len(offsets)

    def is_resident(self, offset: int, num_bytes: int) -> bool:
        """Every page of [offset, offset + num_bytes) is in memory (page-aligned `offset`)."""
        return self.num_resident([offset], num_bytes) == 1

    def populate(self, offset: int, num_bytes: int) -> bool:
        """Map the pages of [offset, offset + num_bytes) into the process before they are read;
        False if one cannot be (an I/O error, or a kernel without MADV_POPULATE_READ)."""
        try:
            self._map.madvise(_MADV_POPULATE_READ, offset, num_bytes)
        except (OSError, ValueError):
            return False
        return True


def open_locked(path: str) -> int:
    """The slot file, opened read-write (created 0600 if missing) and locked for this process."""
    for _ in range(_OPEN_TRIES):
        fd = _open_slot_file(path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise DiskTierInUseError(
                f"disk tier file {path} is in use by another kvtier instance; give each "
                f"instance its own directory, or share a cache between instances with the fs "
                f"tier (fs=DIR in --kv-offload)") from None
        # Another instance's start-up removes unused slot files (tiers/slot_dir.py): one removed
        # between our open and our lock is no longer the file the path names.
        if names_file(path, fd):
            return fd
        os.close(fd)
    raise DiskTierSetupError(f"the disk tier's file {path} was removed {_OPEN_TRIES} times "
                             f"while being opened; is another program deleting it?")


def _open_slot_file(path: str) -> int:
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
    return fd


def pwrite_all(fd: int, buffers: Sequence[Any], offset: int) -> None:
    _whole(os.pwritev, fd, buffers, offset, OSError)


def pread_all(fd: int, buffers: Sequence[Any], offset: int) -> None:
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

