"""Vectored reads and writes that move every byte: a short read or write is continued."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any


def pwrite_all(fd: int, buffers: Sequence[Any], offset: int) -> None:
    _whole(os.pwritev, fd, buffers, offset)


def pread_all(fd: int, buffers: Sequence[Any], offset: int) -> None:
    """Fill `buffers` from `offset` on; OSError at the end of the file."""
    _whole(os.preadv, fd, buffers, offset)


def _whole(io: Callable[[int, list[memoryview], int], int], fd: int, buffers: Sequence[Any],
           offset: int) -> None:
    """Repeat a vectored read or write (`io`) until every byte of `buffers` is moved."""
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        moved = io(fd, views, offset)
        if moved == 0:
            raise OSError(f"{io.__name__} moved nothing at offset {offset} of the file")
        offset += moved
        views = _advance(views, moved)


def _advance(views: list[memoryview], num_bytes: int) -> list[memoryview]:
    """`views` less their first `num_bytes` bytes."""
    while views and num_bytes >= len(views[0]):
        num_bytes -= len(views[0])
        views = views[1:]
    if views and num_bytes:
        views = [views[0][num_bytes:]] + views[1:]
    return views
