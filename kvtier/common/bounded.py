"""A dict bounded in size: setting a key makes it the most recent, and past `max_len` keys the
least recently set one is forgotten. For what the engine remembers per chunk (failed loads, use
counts) without growing with every chunk it ever saw."""

from __future__ import annotations

from collections import OrderedDict
from typing import TypeVar

K = TypeVar("K")
V = TypeVar("V")


class BoundedDict(OrderedDict[K, V]):
    def __init__(self, max_len: int) -> None:
        super().__init__()
        self.max_len = max_len

    def __setitem__(self, key: K, value: V) -> None:
        super().__setitem__(key, value)
        self.move_to_end(key)
        if len(self) > self.max_len:
            self.popitem(last=False)
