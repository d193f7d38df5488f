"""glibc malloc's thresholds for a CPU engine, whose steps allocate and free activations of
megabytes (a 2,048-token prefill chunk's gate and up projections alone: 12 MB of bf16).

By default glibc serves an allocation over 128 KB by mmap and unmaps it when it is freed (the
threshold then rises to that size, up to 32 MB), and trims the top of its heap once twice the
threshold lies free there. Either way many of the next step's buffers are fresh pages the
kernel faults in and zeroes again. A CPU engine serves them from the heap instead: mmap only
above 32 MB (glibc's largest threshold; the KV cache, allocated once, is larger) and trimming
only once 256 MB lies free. On the 2-core Intel VM of docs/benchmarks.md,
`offline_throughput.py --output-len 1` (64 prompts of 512 tokens) took 7.07 s on average against
7.44 s (six runs each, alternated; noisy) and its process took 250,000 minor page faults against
553,000, with the same peak RSS. The cost: up to 256 MB of freed memory the process keeps
(vLLM's CPU guide asks for tcmalloc for the same reason).
"""

from __future__ import annotations

import logging
import sys

from kvtier.common.libc import load_libc

logger = logging.getLogger(__name__)

MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20
# glibc <malloc.h>
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def keep_step_buffers_in_heap() -> bool:
    """Set glibc's mmap and trim thresholds (above) for this process; True if glibc took both
    (False elsewhere: another C library, or not Linux). Idempotent."""
    if not sys.platform.startswith("linux"):
        return False
    libc = load_libc()
    if libc is None or not hasattr(libc, "mallopt"):
        return False
    took = (libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
            and libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1)
    if not took:
        logger.debug("mallopt declined the mmap/trim thresholds: malloc's defaults stay")
    return took
