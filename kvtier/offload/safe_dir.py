"""File operations that cannot be led out of a directory by a symlink planted in it.

A shared cache directory may be writable by others: a symlink put where a chunk file or a
subdirectory is expected would otherwise make a store write (or an eviction delete) a file
anywhere the engine may. Every operation here works relative to an open directory descriptor
and opens its last component with O_NOFOLLOW, so it acts on that directory's own entry or
fails. Directories are created 0700 and files 0600: chunks are the engine's, not the world's.

A temp file of `write_atomically` is named after its writer (`<name>.<host>.<pid>.<tid>.tmp`,
`host` standing for this kernel boot and pid namespace), so that a scan can tell one a killed
process left (`is_abandoned_temp`) from one being written.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import os
import stat
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import BinaryIO

DIR_MODE = 0o700
FILE_MODE = 0o600
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# A temp file whose writer has not written it for this long is abandoned whoever wrote it (a
# process of another host or container, whose pid means nothing here): far past a tier job's
# deadline (tier_job_timeout_s, 30 s by default), so no write still running loses its file.
ABANDONED_TEMP_S = 300.0


class SymlinkRefusedError(OSError):
    """A directory entry that must be a real directory or file is a symlink (or not a
    directory); nothing is read, written or deleted through it."""


class NotRegularFileError(OSError):
    """A file to read is a FIFO, device, socket or directory; it is not opened for reading."""


def open_dir(name: str, dir_fd: int | None = None, create: bool = False) -> int:
    """A descriptor of directory `name` (relative to `dir_fd`), never through a symlink at its
    last component; with `create`, made 0700 when missing. The caller closes it."""
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise SymlinkRefusedError(exc.errno, f"{name} is a symlink or not a directory; "
                                                 f"refused (remove it)") from None
        raise


@contextlib.contextmanager
def opened_dir(name: str, dir_fd: int | None = None, create: bool = False) -> Iterator[int]:
    fd = open_dir(name, dir_fd, create)
    try:
        yield fd
    finally:
        os.close(fd)


def open_file(name: str, dir_fd: int, flags: int) -> int:
    """Open the regular file `name` in `dir_fd` (O_NOFOLLOW: a symlink is refused)."""
    try:
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, FILE_MODE, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SymlinkRefusedError(exc.errno, f"{name} is a symlink; refused") from None
        raise


def open_regular_file(name: str, dir_fd: int) -> int:
    """Open the regular file `name` in `dir_fd` for reading. Opened without blocking, so that a
    FIFO or device planted under its name cannot hold the thread, and refused unless regular
    (NotRegularFileError); then blocking again, as reads expect."""
    fd = open_file(name, dir_fd, os.O_RDONLY | os.O_NONBLOCK)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise NotRegularFileError(errno.EINVAL, f"{name} is not a regular file; refused")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def names_file(name: str, fd: int, dir_fd: int | None = None) -> bool:
    """Whether the entry `name` (of `dir_fd`) is still the open file `fd` (not removed, nor
    replaced by another file)."""
    try:
        entry = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return False
    opened = os.fstat(fd)
    return (entry.st_dev, entry.st_ino) == (opened.st_dev, opened.st_ino)


def is_regular_file(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def write_atomically(name: str, dir_fd: int, write: Callable[[BinaryIO], None]) -> None:
    """Write `name` in `dir_fd` through a temporary file renamed into place: a reader sees the
    whole file or none. The rename replaces a symlink of that name, never its target."""
    tmp = f"{name}.{_HOST}.{os.getpid()}.{threading.get_ident()}.tmp"
    unlink_quietly(tmp, dir_fd)  # left by a crashed process of the same pid
    fd = open_file(tmp, dir_fd, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        unlink_quietly(tmp, dir_fd)
        raise


def unlink_quietly(name: str, dir_fd: int) -> bool:
    """Delete the entry `name` of `dir_fd` (a symlink itself, never its target)."""
    try:
        os.unlink(name, dir_fd=dir_fd)
        return True
    except OSError:
        return False


def is_abandoned_temp(name: str, age_s: float) -> bool:
    """Whether the temp file `name` of `write_atomically`, last written `age_s` seconds ago, is
    left by a writer that is gone: a dead process of this host, or any after ABANDONED_TEMP_S."""
    if age_s > ABANDONED_TEMP_S:
        return True
    parts = name.rsplit(".", 4)  # name, host, pid, tid, "tmp"
    if len(parts) != 5 or parts[1] != _HOST or not parts[2].isdigit():
        return False
    try:
        os.kill(int(parts[2]), 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # alive, another user's
    return False


def _host_id() -> str:
    """Names this kernel boot and pid namespace: where a temp file's pid can be looked up."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:  # not Linux: no process checks a pid this one wrote
        return uuid.uuid4().hex[:16]
    return hashlib.sha256(f"{boot}/{pid_ns}".encode()).hexdigest()[:16]


_HOST = _host_id()
