"""One OpenMP team per process: the engine thread's.

Torch runs CPU ops on OpenMP. Every thread that starts a parallel op gets its own team, whose
worker threads stay alive, idle, for the life of that thread. libgomp counts them all, and once
a process has more OpenMP threads than CPUs it stops spinning at barriers: each thread of the
engine's team then sleeps and is woken at nearly every barrier of every op (hundreds per
forward). Measured on 2 cores: a decode benchmark went from 0 to ~400 voluntary context switches
per step, and a server at 128 conversations slowed by ~1.5x.

So the engine thread builds the engine it runs (kvtier.engine.async_llm), and every other thread
that calls torch (offload copies, the HTTP loop) runs its ops on itself alone:
`use_one_cpu_thread()`.
"""

from __future__ import annotations

import ctypes
import logging
import sys
from functools import lru_cache

import torch

logger = logging.getLogger(__name__)


def use_one_cpu_thread() -> None:
    """Make torch's CPU ops on the calling thread single-threaded, for this thread only.

    torch.set_num_threads(1) would not do: it also sets the default for threads that have not
    run a parallel op yet, the engine thread among them. OpenMP's own setting is per thread.
    Use as a ThreadPoolExecutor initializer. A no-op where torch does not use OpenMP.
    """
    openmp = _torch_openmp()
    if openmp is None:
        return
    # torch sets a thread's OpenMP thread count at its first parallel op (from the process
    # default); asking for the count does that now, so the 1 below is not overwritten later.
    torch.get_num_threads()
    openmp.omp_set_num_threads(1)
    if torch.get_num_threads() != 1:
        logger.warning("could not make this thread's torch ops single-threaded (torch still "
                       "reports %d threads)", torch.get_num_threads())


@lru_cache(maxsize=1)
def _torch_openmp() -> ctypes.CDLL | None:
    """torch's CPU library, through which its OpenMP runtime's functions resolve; None where
    torch does not use OpenMP or the library is not found (not Linux)."""
    if "OpenMP" not in torch.__config__.parallel_info() or not sys.platform.startswith("linux"):
        return None
    # Other packages bring their own libgomp copies (sentencepiece does): the one to set is
    # the one libtorch_cpu links, so symbols are looked up from libtorch_cpu (dlsym searches a
    # library's own dependencies).
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libtorch_cpu" in line}
    except OSError:
        paths = set()
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)  # already loaded: dlopen returns the same library
            library.omp_set_num_threads  # noqa: B018 -- raises AttributeError when missing
            return library
        except (OSError, AttributeError):
            continue
    logger.warning("torch uses OpenMP but its libgomp was not found; threads other than the "
                   "engine's keep their own OpenMP teams (slower on few cores)")
    return None
