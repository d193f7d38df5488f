"""Under write_back: when dirty host chunks go down to the write-back tiers.

A dirty chunk is held nowhere below the device. It is written out, oldest first, once the host
tier runs short of slots it could evict at once (the reserve below), and all of them at
shutdown. A chunk is taken only when every write-back tier that admits it can take a store now
(`max_pending_stores`): dropped for backpressure it would be clean, and held nowhere; it stays
dirty until they can.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from kvtier.offload.host_cache import HostCache
from kvtier.offload.keys import ChunkKey

# The host slots kept free or clean and idle (evictable at once, nothing lost), counting chunks
# whose write-back is under way: this share of them, and at least twice the most slots taken
# between two polls so far (stores and promotions; one step's arrive while the previous step's
# write-backs may still pin their slots). A 1 GiB host tier of SmolLM2 bf16 chunks has ~2900
# slots; a step of 2048 tokens stores up to 128 chunks.
WRITE_BACK_RESERVE = 0.1


class WriteBack:
    def __init__(self, host: HostCache, num_slots: int, can_write: Callable[[ChunkKey], bool],
                 write: Callable[[ChunkKey], None]) -> None:
        """`can_write(key)`: whether the tiers `write(key)` would store `key` on take a store
        now."""
        self.host = host
        self._num_slots = num_slots
        self._can_write = can_write
        self._write = write
        self._reserve = max(1, math.ceil(WRITE_BACK_RESERVE * num_slots))
        self._slots_taken_at_poll = 0

    def write_all(self) -> None:
        """Every dirty chunk the tiers take now (shutdown: keep what this instance computed)."""
        while self.host.num_dirty and self._write_oldest():
            pass

    def keep_reserve(self, num_writing: int) -> None:
        """At each poll: write the oldest dirty chunks out until the reserve of evictable slots
        is met (`num_writing`: chunks whose write-back is under way)."""
        taken = self.host.num_slots_taken - self._slots_taken_at_poll
        self._slots_taken_at_poll = self.host.num_slots_taken
        self._reserve = min(self._num_slots, max(self._reserve, 2 * taken))
        available = self.host.num_evictable_now() + num_writing
        while available < self._reserve and self.host.num_dirty and self._write_oldest():
            available += 1

    def _write_oldest(self) -> bool:
        key = self.host.oldest_dirty()
        if not self._can_write(key):
            return False
        self.host.mark_clean(key)
        self._write(key)
        return True
