"""What the fs tier's namespace directory holds, across every instance that writes it.

A scan lists the chunk files (the candidates for eviction) and the temp files of writes in
progress, which take space until renamed into place: they are counted, never evicted. A temp
file its writer abandoned (a process killed mid-write, `safe_dir.is_abandoned_temp`) would be
neither renamed nor removed by anyone else, so the scan removes it.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvtier.offload.safe_dir import is_abandoned_temp, opened_dir, unlink_quietly

logger = logging.getLogger(__name__)

CHUNK_SUFFIX = ".kvc"
_TEMP_SUFFIX = ".tmp"


class ChunkFile(NamedTuple):
    sub: str  # the namespace directory's subdirectory holding it
    name: str
    size: int
    mtime: float  # the last store or load: eviction goes by it


@dataclass
class DirectoryScan:
    files: list[ChunkFile] = field(default_factory=list)
    # Bytes of the temp files of writes in progress.
    temp_bytes: int = 0
    num_removed_temps: int = 0
    removed_temp_bytes: int = 0

    @property
    def used_bytes(self) -> int:
        return sum(file.size for file in self.files) + self.temp_bytes


def scan_directory(directory: str, on_symlink: Callable[[str], None]) -> DirectoryScan:
    """Scan the namespace directory `directory`; its symlinked subdirectories are left out and
    passed to `on_symlink`. A directory that is missing or removed meanwhile holds nothing."""
    scan = DirectoryScan()
    try:
        with opened_dir(directory) as ns_fd:
            for sub in os.scandir(ns_fd):
                if sub.is_symlink():
                    on_symlink(sub.name)
                elif sub.is_dir(follow_symlinks=False):
                    _scan_subdir(ns_fd, sub.name, scan)
    except OSError:
        pass  # no directory yet (read-only), or it was removed meanwhile
    return scan


def _scan_subdir(ns_fd: int, sub: str, scan: DirectoryScan) -> None:
    now = time.time()  # mtimes are wall-clock times
    try:
        with opened_dir(sub, ns_fd) as fd:
            for entry in os.scandir(fd):
                is_chunk = entry.name.endswith(CHUNK_SUFFIX)
                if not (is_chunk or entry.name.endswith(_TEMP_SUFFIX)):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:
                    continue  # deleted by another instance meanwhile
                if not stat.S_ISREG(st.st_mode):
                    continue
                if is_chunk:
                    scan.files.append(ChunkFile(sub, entry.name, st.st_size, st.st_mtime))
                elif not is_abandoned_temp(entry.name, now - st.st_mtime):
                    scan.temp_bytes += st.st_size
                elif unlink_quietly(entry.name, fd):
                    scan.num_removed_temps += 1
                    scan.removed_temp_bytes += st.st_size
    except OSError:
        pass  # replaced or removed meanwhile
