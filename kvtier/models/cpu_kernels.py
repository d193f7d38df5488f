"""kvtier's C++ CPU kernels (kvtier/models/csrc): built with the machine's compiler on first use
and cached by torch (~/.cache/torch_extensions, or $TORCH_EXTENSIONS_DIR) under a name that
carries a digest of the sources, so only the first process on a machine pays the ~30 s build of
each version.

The kernels are an optimisation, never a requirement: when the build fails (no compiler, no
ninja) or `KVTIER_CPU_KERNELS=0` is set, callers get None and use the pure-torch path, which the
tests hold to the same reference.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

DISABLE_ENV = "KVTIER_CPU_KERNELS"
_CSRC = Path(__file__).parent / "csrc"
_SOURCES = tuple(_CSRC / name
                 for name in ("paged_decode.cpp", "paged_prefill.cpp", "fused_ops.cpp",
                              "page_copy.cpp", "kv_fp8.cpp"))
# Included by the sources: part of the build's digest, not compiled on their own.
_HEADERS = tuple(_CSRC / name
                 for name in ("paged_decode_amx.h", "paged_prefill.h", "paged_prefill_bf16.h",
                              "paged_prefill_amx.h", "amx_tiles.h", "softmax_span.h",
                              "kv_fp8.h"))
# -ffast-math lets expf vectorize; it is a compile flag only, so the process's floating-point
# mode is untouched. -march=native: the cache is per machine. -fopenmp: at::parallel_for is
# inline OpenMP; the extension links libgomp.so.1, which resolves to the copy torch has loaded,
# so both share one thread pool.
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
# A build (or a wait for another process's build) that has not ended by then is given up: the
# process uses the torch path. A first build takes ~30-60 s on 2 cores.
BUILD_DEADLINE_S = 600.0

_lock = threading.Lock()
_loaded: dict[str, Any] = {}  # "ops": torch.ops.kvtier or None once built


def ops():
    """torch.ops.kvtier (built on first call), or None when the kernels are unavailable.

    paged_decode_attention(query (B, Hq, D), kv_cache (2, num_blocks, block_size, Hkv, D),
        block_table (B, n) int64, first_key (B,) int64, seq_lens (B,) int64, scale)
        -> (B, Hq, D): sequence b attends keys [first_key[b], seq_lens[b]); the cache has the
        query's dtype or an fp8 one.
    use_amx_tiles(enable) -> bool: whether the bf16 attention kernels multiply AMX tiles from
        now on (the CPU has AMX-BF16 and the OS lends it); tests pass False to hold the
        vdpbf16ps paths to the reference on the same CPU.
    gather_fp8_pages(pages (N, P) fp8, rows (n,) int64, dtype) -> (n, P) of dtype: the rows'
        pages converted (see kvtier/models/attention.py).
    rms_norm(x, weight, eps), silu_and_mul(x), rotary(x (T, H, D), cos (T, D), sin (T, D)):
        see kvtier/models/fused_ops.py.
    load_pages(host (bytes,) uint8, host_offsets (n,) int64, block_ids (n,) int64, caches):
        copies host block i (its layers' pages in the standard layout, from host_offsets[i]) into
        block block_ids[i] of every layer's cache (parts, num_blocks, ...), in place.
    All tensors contiguous, on the CPU.
    """
    with _lock:
        if "ops" not in _loaded:
            _loaded["ops"] = _build()
    return _loaded["ops"]


def _build():
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    _put_ninja_on_path()
    name = _build_name()
    lock = _remove_stale_lock(name)
    outcome: list[BaseException | None] = []
    # torch waits for another build's lock file with no end: the load runs on a thread that
    # this one waits for with a deadline (a thread left waiting only sleeps).
    thread = threading.Thread(target=_load, args=(name, outcome), daemon=True,
                              name="kvtier-cpu-kernels-build")
    thread.start()
    thread.join(BUILD_DEADLINE_S)
    if not outcome:
        logger.warning("kvtier CPU kernels: the build did not end within %.0f s (waiting for "
                       "%s? remove it if no build is running); using the slower torch "
                       "attention.", BUILD_DEADLINE_S, lock or "another build's lock")
        return None
    if outcome[0] is not None:  # any build failure: the torch path still works
        logger.warning("kvtier CPU kernels unavailable (%s); using the slower torch attention. "
                       "Install a C++ compiler and ninja to enable them, or set %s=0 to skip "
                       "the build.", _last_line(outcome[0]), DISABLE_ENV)
        return None
    return torch.ops.kvtier


def _load(name: str, outcome: list[BaseException | None]) -> None:
    try:
        from torch.utils.cpp_extension import load

        load(name=name, sources=[str(p) for p in _SOURCES], extra_cflags=_CFLAGS,
             extra_ldflags=_LDFLAGS, is_python_module=False, verbose=False)
    except Exception as exc:
        outcome.append(exc)
    else:
        outcome.append(None)


def _remove_stale_lock(name: str) -> str | None:
    """The path of torch's build lock for `name`; removed first when it is older than a build
    can take (a process killed mid-build left it, and every load would wait for it)."""
    try:
        from torch.utils.cpp_extension import _get_build_directory

        lock = os.path.join(_get_build_directory(name, verbose=False), "lock")
        age = time.time() - os.stat(lock).st_mtime
    except (ImportError, OSError):  # no such lock (or a torch that places it elsewhere)
        return None
    if age > BUILD_DEADLINE_S:
        logger.warning("kvtier CPU kernels: removing %s, left %.0f s ago by a build that did "
                       "not finish", lock, age)
        with contextlib.suppress(FileNotFoundError):
            os.remove(lock)
    return lock


def _build_name() -> str:
    """One build directory per version of the sources: torch rebuilds a name whenever its
    sources differ from the last build's, so two checkouts sharing one name on a machine would
    rebuild in turn, each undoing the other's kernels."""
    digest = hashlib.sha256(" ".join(_CFLAGS).encode())
    for path in _SOURCES + _HEADERS:
        digest.update(path.read_bytes())
    return f"kvtier_cpu_kernels_{digest.hexdigest()[:12]}"


def _put_ninja_on_path() -> None:
    """torch runs `ninja` from PATH; a venv used without activation has it only in the pip
    package's own bin directory."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _last_line(exc: Exception) -> str:
    """A build error's first compiler error line, else its last line (not the command line)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line]
    return (errors or lines or [type(exc).__name__])[0 if errors else -1][:300]
