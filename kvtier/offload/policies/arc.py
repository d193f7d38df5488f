"""Adaptive replacement cache (Megiddo & Modha, 2003).

Two resident lists, T1 (seen once recently) and T2 (seen at least twice), and two ghost lists of
recently evicted keys, B1 and B2. A hit in a ghost list moves the target size `p` of T1: a B1 ghost
means T1 was too small, a B2 ghost means T2 was. A one-off scan of new prefixes therefore cannot
flush the chunks that conversations keep coming back to, which plain LRU lets happen.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Hashable

from kvtier.offload.policies.base import EvictionPolicy


class ARCPolicy(EvictionPolicy):
    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.p = 0  # target size of T1
        # Each list is ordered least recently used first.
        self.t1: OrderedDict[Hashable, None] = OrderedDict()
        self.t2: OrderedDict[Hashable, None] = OrderedDict()
        self.b1: OrderedDict[Hashable, None] = OrderedDict()
        self.b2: OrderedDict[Hashable, None] = OrderedDict()

    def insert(self, key: Hashable) -> None:
        if key in self.b1:
            self.p = min(self.capacity, self.p + max(len(self.b2) // len(self.b1), 1))
            del self.b1[key]
            self.t2[key] = None
        elif key in self.b2:
            self.p = max(0, self.p - max(len(self.b1) // len(self.b2), 1))
            del self.b2[key]
            self.t2[key] = None
        else:
            self.t1[key] = None
        self._trim_ghosts()

    def touch(self, key: Hashable) -> None:
        if key in self.t1:
            del self.t1[key]
            self.t2[key] = None
        elif key in self.t2:
            self.t2.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self.t1.pop(key, None)
        self.t2.pop(key, None)

    def pop_victim(self, incoming: Hashable,
                   may_evict: Callable[[Hashable], bool]) -> Hashable | None:
        t1_first = bool(self.t1) and (len(self.t1) > self.p
                                      or (incoming in self.b2 and len(self.t1) == self.p))
        lists = ((self.t1, self.b1), (self.t2, self.b2))
        for resident, ghost in (lists if t1_first else lists[::-1]):
            for key in resident:
                if may_evict(key):
                    del resident[key]
                    ghost[key] = None
                    self._trim_ghosts()
                    return key
        return None

    def _trim_ghosts(self) -> None:
        # The classic bounds: |T1| + |B1| <= c and all four lists together <= 2c.
        while self.b1 and len(self.t1) + len(self.b1) > self.capacity:
            self.b1.popitem(last=False)
        while len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) > 2 * self.capacity:
            ghost = self.b2 if self.b2 else self.b1
            if not ghost:
                break
            ghost.popitem(last=False)

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)
