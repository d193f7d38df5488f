"""The C library, for the few memory calls Python's os and mmap modules lack (madvise on any
address, mincore, glibc's mallopt), with their prototypes set; None where there is no C library
to load."""

from __future__ import annotations

import ctypes
import ctypes.util

_libc: ctypes.CDLL | None = None
_loaded = False


def load_libc() -> ctypes.CDLL | None:
    """The C library (errno kept for `ctypes.get_errno`), loaded once; a call it lacks (mincore
    outside Linux and the BSDs, mallopt outside glibc) is simply missing from it."""
    global _libc, _loaded
    if not _loaded:
        _loaded = True
        name = ctypes.util.find_library("c")
        if name is not None:
            _libc = ctypes.CDLL(name, use_errno=True)
            for call, argtypes in (("madvise", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]),
                                   ("mincore", [ctypes.c_void_p, ctypes.c_size_t,
                                                ctypes.c_void_p]),
                                   ("mallopt", [ctypes.c_int, ctypes.c_int])):
                if hasattr(_libc, call):
                    getattr(_libc, call).argtypes = argtypes
                    getattr(_libc, call).restype = ctypes.c_int
    return _libc
