"""Least recently used: evict the key whose last use is oldest."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from kvtier.offload.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # Oldest use first.
        self._order: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self._order[key] = None
        self._order.move_to_end(key)

    def touch(self, key: Hashable) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self._order.pop(key, None)

    def pop_victim(self, incoming: Hashable,
                   may_evict: Callable[[Hashable], bool]) -> Hashable | None:
        for key in self._order:
            if may_evict(key):
                del self._order[key]
                return key
        return None

    def __len__(self) -> int:
        return len(self._order)
