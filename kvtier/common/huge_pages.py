"""Large CPU buffers on transparent huge pages, where Linux offers them.

The paged KV cache is written and read a page (a few KB) at a time at scattered places: a host
hit's load of an 8k-token prompt writes 15,330 pages of 12 KB into blocks all over the cache.
Once the cache is larger than what the TLB covers in 4 KB pages, nearly every one of those
writes starts with a page walk, and the hardware prefetchers stop at each 4 KB boundary. On the
2-core Zen 5 VM of docs/benchmarks.md, `load_pages` of 511 random blocks into caches of 11,000
blocks a layer (4 GB in all) took 8.9 ms on 4 KB pages and 7.5 ms on 2 MB pages; into caches
of 1,300 blocks a layer (0.5 GB) 7.6 ms either way.
"""

from __future__ import annotations

import ctypes
import logging
import sys

from kvtier.common.libc import load_libc

logger = logging.getLogger(__name__)

HUGE_PAGE_BYTES = 2 << 20
_MADV_HUGEPAGE = 14  # Linux <sys/mman.h>


def advise_huge_pages(address: int, num_bytes: int) -> bool:
    """madvise(MADV_HUGEPAGE) over the whole 2 MB pages inside [address, address + num_bytes);
    True if the kernel took the advice (False: too small, not Linux, or THP disabled)."""
    start = -(-address // HUGE_PAGE_BYTES) * HUGE_PAGE_BYTES
    end = (address + num_bytes) // HUGE_PAGE_BYTES * HUGE_PAGE_BYTES
    if end <= start or not sys.platform.startswith("linux"):
        return False
    libc = load_libc()
    if libc is None or not hasattr(libc, "madvise"):
        return False
    if libc.madvise(ctypes.c_void_p(start), ctypes.c_size_t(end - start), _MADV_HUGEPAGE) != 0:
        logger.debug("madvise(MADV_HUGEPAGE) declined (errno %d): plain pages",
                     ctypes.get_errno())
        return False
    return True

