"""Asking the secondary tiers for a chunk: each query counted once, failed chunks not re-asked.

A tier that raises on a lookup answers NOT_FOUND (a counted error). A chunk that failed to come
back from a tier is not asked of that tier again for FAILED_LOAD_RETRY_S (or until a store of it
there succeeds): a damaged chunk costs one failed read a minute at most, and a chunk that failed
while its store or peer was down is found again once it is back (a p2p tier never stores, so no
later store would clear the failure). A tier that answers UNKNOWN (a remote check in flight) is
asked again later without counting; the query counts once, with its final answer. The calls
for loads straight from a tier's mapped file (`num_mappable`, `pin_mapped`, `release_mapped`) go
through here too: a tier that raises there costs a counted error and a promotion instead.

What each tier is known to hold is remembered from what passes through here and the manager (a
store there, a FOUND answer, a load from there; forgotten at a NOT_FOUND answer, a failed load
or an eviction the tier reports), so that a chunk stored again from the device is not written
again to a tier that has it. A tier that drops a chunk without a word is found out at its next
query for it: the chunk is recomputed then, and its store writes it again.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvtier.common.bounded import BoundedDict
from kvtier.offload.keys import ChunkKey
from kvtier.offload.metrics import OffloadMetrics
from kvtier.offload.tiers.base import LookupResult, MappedChunk, SecondaryTier

# See above: how long a chunk that failed to come back from a tier is not asked of it again.
FAILED_LOAD_RETRY_S = 60.0


class TierQueries:
    def __init__(self, tiers: list[SecondaryTier], metrics: OffloadMetrics,
                 clock: Callable[[], float], remembered: int) -> None:
        """`remembered`: how many failed and undecided chunks each memory holds at most."""
        self.tiers = tiers
        self.names = [tier.context.name for tier in tiers]
        self.metrics = metrics
        self._clock = clock
        # (tier index, key) -> when its load failed
        self._failed: BoundedDict[tuple[int, ChunkKey], float] = BoundedDict(remembered)
        # (tier index, key) pairs whose tier answered UNKNOWN to a counted query
        self._undecided: BoundedDict[tuple[int, ChunkKey], None] = BoundedDict(remembered)
        # (tier index, key) pairs the tier is known to hold (see above); one forgotten is
        # written again at its next store
        self._held: BoundedDict[tuple[int, ChunkKey], None] = BoundedDict(
            remembered * max(1, len(tiers)))

    def ask(self, index: int, key: ChunkKey, req_context: Any, record: bool) -> LookupResult:
        """Tier `index`'s answer for `key`; `record=False`: a repeated query, not counted."""
        failed_at = self._failed.get((index, key))
        if failed_at is not None:
            if self._clock() - failed_at < FAILED_LOAD_RETRY_S:
                return LookupResult.NOT_FOUND
            del self._failed[(index, key)]
        start = self._clock()
        try:
            answer = self.tiers[index].lookup(key, req_context)
        except Exception:  # a broken tier is a miss, never a crash
            self.metrics.error(self.names[index])
            return LookupResult.NOT_FOUND
        if answer is LookupResult.UNKNOWN:
            if record:
                self._undecided[(index, key)] = None
            return answer
        if self._undecided.pop((index, key), False) is None:
            record = True
        if answer is LookupResult.FOUND:
            self._held[(index, key)] = None
        else:
            self._held.pop((index, key), None)
        if record:
            self.metrics.lookup(self.names[index], answer is LookupResult.FOUND,
                                self._clock() - start)
        return answer

    def mark_failed(self, index: int, key: ChunkKey) -> None:
        """`key` failed to come back from tier `index`: do not ask it again for a while, and
        write it there again at its next store."""
        self._failed[(index, key)] = self._clock()
        self._held.pop((index, key), None)

    def mark_stored(self, index: int, key: ChunkKey) -> None:
        """A store of `key` to tier `index` succeeded: it may be asked again at once, and is
        not written there again."""
        self._failed.pop((index, key), None)
        self._held[(index, key)] = None

    def mark_held(self, index: int, key: ChunkKey) -> None:
        """`key` came back from tier `index`: the tier holds it."""
        self._held[(index, key)] = None

    def mark_dropped(self, index: int, key: ChunkKey) -> None:
        """Tier `index` reported `key` evicted."""
        self._held.pop((index, key), None)

    def holds(self, index: int, key: ChunkKey) -> bool:
        """Tier `index` is known to hold `key`: a store of it there would write it again."""
        return (index, key) in self._held

    def num_mappable(self, index: int, keys: Sequence[ChunkKey], num_bytes: int,
                     in_memory: bool = True) -> int:
        """How many of `keys`, from the first, tier `index` can hand over from its mapped file
        (now, or with `in_memory` False once the page cache has them; none past one that
        failed to come back from it lately)."""
        for count, key in enumerate(keys):
            if (index, key) in self._failed:
                keys = keys[:count]
                break
        try:
            return self.tiers[index].num_mappable(keys, num_bytes, in_memory) if keys else 0
        except Exception:
            self.metrics.error(self.names[index])
            return 0

    def pin_mapped(self, chunks: Sequence[tuple[ChunkKey, int]]) -> list[MappedChunk | None]:
        """Each of `chunks` (key, payload bytes) pinned in the first tier's mapped file that
        still has it, or None."""
        pins: list[MappedChunk | None] = [None] * len(chunks)
        for index, tier in enumerate(self.tiers):
            missing = [i for i, pin in enumerate(pins) if pin is None]
            if not missing:
                break
            try:
                pinned = tier.pin_mapped([chunks[i] for i in missing])
            except Exception:
                self.metrics.error(self.names[index])
                continue
            for i, pin in zip(missing, pinned):
                pins[i] = pin
        return pins

    def release_mapped(self, chunk: MappedChunk, key: ChunkKey, ok: bool = True) -> None:
        """The load of `key`, pinned as `chunk`, ended: the tier may overwrite it again. One that
        failed is not taken from that tier again for a while (`mark_failed`), as a failed
        promotion is not: each request would fail it again."""
        index = self.tiers.index(chunk.owner)
        if ok:
            self.mark_held(index, key)
        else:
            self.mark_failed(index, key)
        try:
            chunk.owner.release_mapped(chunk)
        except Exception:
            self.metrics.error(chunk.owner.context.name)
