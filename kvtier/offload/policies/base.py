"""The eviction policy interface of the host tier.

A policy only orders keys; the host cache owns slots and decides which keys may be evicted right
now (a chunk under transfer may not). Keys are opaque hashables.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable


class EvictionPolicy(ABC):
    """Contract: `insert` a key once when it becomes resident, `touch` it on every use, and
    `remove` it when it leaves for a reason other than eviction. `pop_victim` picks the next
    key to evict among those `may_evict` accepts, forgets it as resident and returns it (or
    None when nothing may be evicted)."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"eviction policy capacity must be >= 1, got {capacity}")
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: Hashable) -> None: ...

    @abstractmethod
    def touch(self, key: Hashable) -> None: ...

    @abstractmethod
    def remove(self, key: Hashable) -> None: ...

    @abstractmethod
    def pop_victim(self, incoming: Hashable,
                   may_evict: Callable[[Hashable], bool]) -> Hashable | None: ...

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys."""
