"""The host tier: which chunk lives in which host slot, with two-phase moves in and out.

A chunk being written into its slot (from the device or a secondary tier) is not yet readable
and is unknown to the eviction policy, so it cannot be evicted. A chunk being read out of its
slot (to the device, or by a tier's store) holds a reader count and cannot be evicted either.

Under write-back a chunk from the device is *dirty* until it is handed to the secondary tiers:
the only copy below the device. Eviction takes a clean chunk when there is one; a dirty victim
is dropped and counted, so that a store is never refused for it.

The engine thread makes every move; a p2p tier's serving thread only pins ready chunks to send
them to peers (`pin_ready`, `complete_load`). A lock around the moves that touch readers, busy
chunks and free slots keeps that pin from racing an eviction.
"""

from __future__ import annotations

import enum
import threading
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from kvtier.offload.host_area import HostArea, SlotId
from kvtier.offload.policies.base import EvictionPolicy


class ChunkState(enum.Enum):
    WRITING = "writing"
    READY = "ready"


@dataclass
class HostEntry:
    slot: SlotId
    state: ChunkState
    # The chunk's size; slots fit the largest group's chunk, a smaller group's uses a prefix.
    num_bytes: int
    num_readers: int = 0


class HostCache:
    def __init__(self, area: HostArea, policy: EvictionPolicy) -> None:
        self.area = area
        self.policy = policy
        self.entries: dict[Hashable, HostEntry] = {}
        # Reversed so that slots are handed out 0, 1, 2, ... (stable ids for tests and logs).
        self._free_slots: list[SlotId] = [SlotId(s) for s in reversed(range(area.num_slots))]
        self._evicted: list[Hashable] = []
        # Dirty chunks in the order they arrived (oldest first), and how many were evicted dirty.
        self._dirty: OrderedDict[Hashable, None] = OrderedDict()
        self.num_dropped_dirty = 0
        # Chunks being written into their slot or read out of it: not evictable now.
        self._busy: set[Hashable] = set()
        self.num_slots_taken = 0  # slots handed out so far (stores and promotions)
        self._lock = threading.Lock()

    def is_ready(self, key: Hashable) -> bool:
        entry = self.entries.get(key)
        return entry is not None and entry.state is ChunkState.READY

    def prepare_store(self, key: Hashable, num_bytes: int) -> SlotId | None:
        """Reserve a slot for `key`, evicting if needed. None if `key` is already here (or on
        its way) or every resident chunk is busy."""
        with self._lock:
            if key in self.entries:
                return None
            slot = self._take_slot(key)
            if slot is not None:
                self.entries[key] = HostEntry(slot=slot, state=ChunkState.WRITING,
                                              num_bytes=num_bytes)
                self._busy.add(key)
                self.num_slots_taken += 1
            return slot

    def complete_store(self, key: Hashable, ok: bool) -> None:
        with self._lock:
            entry = self.entries[key]
            assert entry.state is ChunkState.WRITING, f"complete_store of a {entry.state} chunk"
            self._busy.discard(key)
            if ok:
                entry.state = ChunkState.READY
                self.policy.insert(key)
            else:
                del self.entries[key]
                self._free_slots.append(entry.slot)

    def count_ready(self, keys: Sequence[Hashable]) -> int:
        """How many of `keys`, from the first, are ready here."""
        entries = self.entries
        for index, key in enumerate(keys):
            entry = entries.get(key)
            if entry is None or entry.state is not ChunkState.READY:
                return index
        return len(keys)

    def prepare_loads(self, keys: Sequence[Hashable]) -> list[SlotId | None]:
        """Pin each of `keys` that is ready for a request's read (a use the eviction policy
        sees), under one hold of the lock; None for one that is not (evicted since its
        lookup)."""
        slots: list[SlotId | None] = []
        with self._lock:
            for key in keys:
                entry = self.entries.get(key)
                if entry is None or entry.state is not ChunkState.READY:
                    slots.append(None)
                    continue
                entry.num_readers += 1
                self._busy.add(key)
                slots.append(entry.slot)
        for key, slot in zip(keys, slots):
            if slot is not None:
                self.policy.touch(key)
        return slots

    def prepare_load(self, key: Hashable, count_use: bool = True) -> SlotId:
        """Pin a ready chunk for reading; `count_use`: a request uses it (the eviction policy
        sees a use), not a secondary tier copying it (which must not make it look hot)."""
        with self._lock:
            entry = self.entries[key]
            assert entry.state is ChunkState.READY, f"prepare_load of a {entry.state} chunk"
            entry.num_readers += 1
            self._busy.add(key)
        if count_use:
            self.policy.touch(key)
        return entry.slot

    def pin_ready(self, key: Hashable) -> memoryview | None:
        """Pin `key` for reading if it is ready here (a view of its bytes), else None. Safe from
        any thread; `complete_load` unpins. The eviction policy sees no use: a peer's read must
        not keep a chunk this instance no longer uses."""
        with self._lock:
            entry = self.entries.get(key)
            if entry is None or entry.state is not ChunkState.READY:
                return None
            entry.num_readers += 1
            self._busy.add(key)
            return self.area.slot_view(entry.slot, entry.num_bytes)

    def complete_load(self, key: Hashable) -> None:
        self.complete_loads((key,))

    def complete_loads(self, keys: Iterable[Hashable]) -> None:
        """Unpin each of `keys` (read), under one hold of the lock."""
        with self._lock:
            for key in keys:
                entry = self.entries[key]
                assert entry.num_readers > 0, "complete_load without prepare_load"
                entry.num_readers -= 1
                if entry.num_readers == 0:
                    self._busy.discard(key)

    def mark_dirty(self, key: Hashable) -> None:
        """`key` (ready) is held nowhere below the device yet."""
        self._dirty[key] = None

    def oldest_dirty(self) -> Hashable | None:
        """The dirty chunk that arrived first."""
        return next(iter(self._dirty), None)

    def mark_clean(self, key: Hashable) -> None:
        """`key` is being written out (the caller hands it to the tiers)."""
        del self._dirty[key]

    @property
    def num_dirty(self) -> int:
        return len(self._dirty)

    def num_evictable_now(self) -> int:
        """Free slots plus clean chunks no transfer holds: what stores can take without
        dropping a dirty chunk."""
        with self._lock:
            busy_clean = sum(1 for key in self._busy if key not in self._dirty)
        return (len(self._free_slots) + len(self.entries) - len(self._dirty) - busy_clean)

    def view(self, key: Hashable) -> memoryview:
        entry = self.entries[key]
        return self.area.slot_view(entry.slot, entry.num_bytes)

    def take_evicted(self) -> list[Hashable]:
        evicted, self._evicted = self._evicted, []
        return evicted

    @property
    def num_used_slots(self) -> int:
        return len(self.entries)

    @property
    def fill_ratio(self) -> float:
        return len(self.entries) / self.area.num_slots

    def _take_slot(self, incoming: Hashable) -> SlotId | None:
        if self._free_slots:
            return self._free_slots.pop()
        victim = self.policy.pop_victim(incoming, self._may_evict_clean)
        if victim is None and self._dirty:
            victim = self.policy.pop_victim(incoming, self._may_evict)  # only dirty ones left
            if victim is not None:
                del self._dirty[victim]
                self.num_dropped_dirty += 1
        if victim is None:
            return None
        self._evicted.append(victim)
        return self.entries.pop(victim).slot

    def _may_evict(self, key: Hashable) -> bool:
        return self.entries[key].num_readers == 0

    def _may_evict_clean(self, key: Hashable) -> bool:
        return self.entries[key].num_readers == 0 and key not in self._dirty
