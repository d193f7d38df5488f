"""The host area: one preallocated buffer cut into equal chunk slots.

Allocated once at start-up (no allocation per transfer); tiers and copy handlers get views of it,
never copies. Slots are sized for the largest chunk of any KV cache group, so one pool serves a
hybrid model's groups alike.
"""

from __future__ import annotations

import mmap
from typing import NewType

import numpy as np

SlotId = NewType("SlotId", int)


class HostArea:
    """`num_slots` slots of `slot_bytes` each, carved out of a byte budget."""

    def __init__(self, budget_bytes: int, slot_bytes: int) -> None:
        if slot_bytes <= 0:
            raise ValueError(f"slot_bytes must be > 0, got {slot_bytes}")
        self.slot_bytes = slot_bytes
        self.num_slots = budget_bytes // slot_bytes
        if self.num_slots < 1:
            raise ValueError(f"the host tier's budget ({budget_bytes} bytes: --kv-offload host=, "
                             f"or cpu_bytes_to_use) holds no chunk; it must be at least one "
                             f"chunk ({slot_bytes} bytes; blocks_per_chunk sets its size)")
        # uint8 so any KV dtype can be viewed through it (the worker views it as torch tensors).
        self.buffer = _populated_zeros(self.num_slots * slot_bytes)
        self._bytes = memoryview(self.buffer)  # sliced per job: made once

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.slot_bytes

    def slot_array(self, slot: SlotId) -> np.ndarray:
        start = slot * self.slot_bytes
        return self.buffer[start:start + self.slot_bytes]

    def slot_view(self, slot: SlotId, num_bytes: int | None = None) -> memoryview:
        """A zero-copy writable view of the slot's first `num_bytes` (default: all of it)."""
        start = slot * self.slot_bytes
        end = start + (self.slot_bytes if num_bytes is None else num_bytes)
        return self._bytes[start:end]


def _populated_zeros(num_bytes: int) -> np.ndarray:
    """Zeroed bytes whose pages exist already, where the OS can do that (Linux MAP_POPULATE).

    Left lazy, every slot's first store pays the page faults on the engine's critical path (the
    next step waits for its stores): on the 2-core VM of docs/benchmarks.md a 47 MB store took
    117 ms into fresh np.zeros pages (numpy asks for transparent huge pages, which the kernel
    compacts memory for on fault) and 4 ms into populated ones; populating 1 GiB at start-up
    takes 0.4 s there.
    """
    if num_bytes > 0 and hasattr(mmap, "MAP_POPULATE"):
        mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
                            | mmap.MAP_POPULATE)
        return np.frombuffer(mapping, dtype=np.uint8)  # keeps the mapping alive
    return np.zeros(num_bytes, dtype=np.uint8)
