"""Real read-only and small file systems for the tier tests: a read-only bind mount and a tiny
tmpfs. Both need mount(8) and the right to mount (root in a container that allows it); a test
that gets neither is skipped, saying why."""

import contextlib
import subprocess

import pytest


def _mount(*args: str) -> None:
    out = subprocess.run(["mount", *args], capture_output=True, text=True, timeout=30)
    if out.returncode != 0:
        pytest.skip(f"mount {' '.join(args)} is not permitted here ({out.stderr.strip()}); "
                    f"this test needs a real read-only or full file system")


def _unmount(path) -> None:
    subprocess.run(["umount", str(path)], capture_output=True, timeout=30, check=True)


@contextlib.contextmanager
def bind_mount(source, target):
    """`target` shows `source` (writable until `remounted_read_only`)."""
    target.mkdir(exist_ok=True)
    _mount("--bind", str(source), str(target))
    try:
        yield target
    finally:
        _unmount(target)


@contextlib.contextmanager
def read_only_view(source, target):
    """`target` shows `source` read-only; `source` stays writable."""
    with bind_mount(source, target):
        _mount("-o", "remount,ro,bind", str(target))
        yield target


@contextlib.contextmanager
def small_tmpfs(target, size: str):
    """A tmpfs of `size` bytes at `target`: writes past it fail with ENOSPC."""
    target.mkdir(exist_ok=True)
    _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(target))
    try:
        yield target
    finally:
        _unmount(target)


@contextlib.contextmanager
def remounted_read_only(target):
    """Make the bind mount at `target` read-only until the block ends."""
    _mount("-o", "remount,ro,bind", str(target))
    try:
        yield target
    finally:
        _mount("-o", "remount,rw,bind", str(target))
