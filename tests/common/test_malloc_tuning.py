"""A CPU engine keeps its step buffers in malloc's heap: freed and allocated again, a buffer of
megabytes is not a fresh mapping the kernel has to fault in again."""

import subprocess
import sys

import pytest

from kvtier.common.libc import load_libc

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not hasattr(load_libc(), "mallopt"),
    reason="no glibc mallopt here")

# 20 MB buffers (a prefill chunk's activations), each written, freed and allocated again; the
# page faults of the last four rounds.
_ROUNDS = """
import resource, sys
from kvtier.common.malloc_tuning import keep_step_buffers_in_heap
if sys.argv[1] == "tuned":
    assert keep_step_buffers_in_heap()
def round_trip():
    buffer = bytearray(20 << 20)
    buffer[::4096] = b"x" * len(buffer[::4096])
    del buffer
round_trip()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    round_trip()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", _ROUNDS, mode], capture_output=True,
                          text=True, timeout=60, check=True)
    return int(done.stdout.strip())


def test_freed_step_buffers_are_reused_without_page_faults():
    tuned, default = _faults("tuned"), _faults("default")
    # 4 rounds of 5,120 pages: glibc's default maps and unmaps each buffer anew.
    assert tuned < 1_000
    assert default > 4 * tuned
