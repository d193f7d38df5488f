"""How much host memory this machine can give now, for start-up checks that refuse a size no
allocation could meet (a failed allocation says only "Cannot allocate memory", or never fails and
the process is killed mid-way)."""

from __future__ import annotations

import os

_MEMINFO = "/proc/meminfo"


def available_memory_bytes() -> int | None:
    """Bytes the kernel can hand out without swapping (Linux MemAvailable: free memory plus
    reclaimable caches); elsewhere the free pages; None where neither is known."""
    try:
        with open(_MEMINFO) as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024  # the file says kB and means KiB
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def format_bytes(num_bytes: int) -> str:
    """1536 -> "1.5 KiB": in the binary units --kv-cache-memory-bytes and --kv-offload take, so
    a user can give a smaller size back."""
    if num_bytes < 1024:
        return f"{num_bytes} B"
    value = num_bytes / 1024
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            return f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} PiB"
