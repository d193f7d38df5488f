"""File operations that cannot be led out of a directory by a symlink planted in it.

A shared cache directory may be writable by others: a symlink put where a chunk file or a
subdirectory is expected would otherwise make a store write (or an eviction delete) a file
anywhere the engine may. Every operation here works relative to an open directory descriptor
and opens its last component with O_NOFOLLOW, so it acts on that directory's own entry or
fails. Directories are created 0700 and files 0600: chunks are the engine's, not the world's.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import threading
from collections.abc import Callable, Iterator
from typing import BinaryIO

DIR_MODE = 0o700
FILE_MODE = 0o600
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class SymlinkRefusedError(OSError):
    """A directory entry that must be a real directory or file is a symlink (or not a
    directory); nothing is read, written or deleted through it."""


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


def is_regular_file(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISREG(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def write_atomically(name: str, dir_fd: int, write: Callable[[BinaryIO], None]) -> None:
    """Write `name` in `dir_fd` through a temporary file renamed into place: a reader sees the
    whole file or none. The rename replaces a symlink of that name, never its target."""
    tmp = f"{name}.{os.getpid()}.{threading.get_ident()}.tmp"
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
