"""The disk tier's directory: the slot file of this instance's namespace, and no stale others.

The slot file's name is its namespace (weights, dtype, block size, blocks_per_chunk, chunk
format), so each change of model or configuration would leave a preallocated file of the
directory's full size behind. At start-up, after taking its own file, the tier removes the slot
files (and their `.json` descriptions) of other namespaces that no running instance holds: it
takes each one's lock without waiting, as their owners hold it while they run. Files another
instance holds are left alone and logged: that instance's budget is its own.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat

from kvtier.offload.safe_dir import DIR_MODE, names_file, opened_dir, unlink_quietly
from kvtier.offload.tiers.slot_file import DiskTierSetupError, open_locked

logger = logging.getLogger(__name__)

SUFFIX = ".kvslots"


def open_slot_file(root: str, namespace: bytes, tier_name: str) -> tuple[str, int]:
    """(path, locked descriptor) of `namespace`'s slot file in the resolved directory `root`,
    created (0700) if missing; other namespaces' unused slot files there are removed."""
    try:
        os.makedirs(root, DIR_MODE, exist_ok=True)
    except OSError as exc:
        raise DiskTierSetupError(f"cannot create the disk tier's directory {root}: "
                                 f"{exc.strerror}; choose a writable directory") from exc
    path = os.path.join(root, namespace.hex() + SUFFIX)
    fd = open_locked(path)
    try:
        _remove_unused(root, os.path.basename(path), tier_name)
    except OSError as exc:  # a sweep that fails costs disk space, never the tier
        logger.warning("disk tier %s: cannot look for unused slot files in %s: %s", tier_name,
                       root, exc)
    return path, fd


def _remove_unused(root: str, own: str, tier_name: str) -> None:
    removed: list[tuple[str, int]] = []  # (name, bytes freed)
    in_use: list[tuple[str, int]] = []
    with opened_dir(root) as root_fd:
        names = [entry.name for entry in os.scandir(root_fd)
                 if entry.name.endswith(SUFFIX) and entry.name != own
                 and entry.is_file(follow_symlinks=False)]
        for name in names:
            outcome = _remove_if_unused(name, root_fd)
            if outcome is not None:
                (removed if outcome[0] else in_use).append((name, outcome[1]))
    if removed:
        logger.info("disk tier %s: removed %d slot file(s) of other namespaces that no instance "
                    "uses from %s, freeing %d bytes: %s", tier_name, len(removed), root,
                    sum(size for _, size in removed), ", ".join(name for name, _ in removed))
    if in_use:
        logger.warning("disk tier %s: %d slot file(s) of other namespaces in %s (%d bytes) are in "
                       "use by other instances and left alone: %s", tier_name, len(in_use), root,
                       sum(size for _, size in in_use), ", ".join(name for name, _ in in_use))


def _remove_if_unused(name: str, root_fd: int) -> tuple[bool, int] | None:
    """(removed, bytes on disk) for the slot file `name`: removed unless another process holds
    its lock (then False); None if it is gone, not a regular file or cannot be opened."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=root_fd)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return None
        size = st.st_blocks * 512  # what the file takes on disk (preallocated: all of it)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False, size
        # A sweeper that removed it before we locked it leaves the name free for a new owner's
        # file: the name must still be the file we hold.
        if not names_file(name, fd, root_fd):
            return None
        os.unlink(name, dir_fd=root_fd)
        unlink_quietly(name[:-len(SUFFIX)] + ".json", root_fd)
        return True, size
    finally:
        os.close(fd)  # releases the lock

