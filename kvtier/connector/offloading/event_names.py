"""Tier moves as KV events: each chunk named by its blocks' hashes, so that a router indexing
the engine's events learns which blocks host memory and each secondary tier hold.

Loads into the device are left out: the device cache publishes those blocks itself. With more
than one block a chunk, two chunks can hold the same block (two prompts that part within a
chunk): a tier announces a block when the first chunk it holds that holds it arrives, and its
removal when the last one leaves, and each chunk's arrival only once.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence

from kvtier.common.bounded import BoundedDict
from kvtier.events import BlockRemoved, BlockStored, WireEvent, external_block_hash
from kvtier.events.schema import MEDIUM_CPU, MEDIUM_STORAGE
from kvtier.kv import BlockHash
from kvtier.offload.config import OffloadConfig
from kvtier.offload.events import DEVICE, HOST, TierMoveEvent
from kvtier.offload.keys import ChunkKey

# Chunks whose block hashes are remembered, per host slot (the rest are forgotten, least
# recently named first): host memory holds one chunk a slot, the tiers behind it more.
_NAMED_CHUNKS_PER_SLOT = 16


class TierEventNames:
    def __init__(self, options: OffloadConfig, block_size: int, num_host_slots: int,
                 group_id: int) -> None:
        """Names the chunks of KV cache group `group_id` (every group of a hybrid model holds
        the same blocks: one group's chunks name them all)."""
        self.block_size = block_size
        self.group_id = group_id
        self.blocks_per_chunk = options.blocks_per_chunk
        self._chunk_blocks: BoundedDict[ChunkKey, tuple[BlockHash, ...]] = BoundedDict(
            _NAMED_CHUNKS_PER_SLOT * num_host_slots)
        # (medium, ownership) by tier: host memory is "CPU", a secondary tier "STORAGE" with
        # its name as the owner, as vLLM's offloading events name them.
        self._media = {HOST: (MEDIUM_CPU, None), **{
            spec.name: (MEDIUM_STORAGE, spec.name) for spec in options.secondary_tiers}}
        # Per tier, the chunks announced there (oldest first, as many as are named at most:
        # a shared store never reports its evictions), and how many of them hold each block.
        self._max_held = self._chunk_blocks.max_len
        self._held: dict[str, OrderedDict[ChunkKey, tuple[BlockHash, ...]]] = {
            tier: OrderedDict() for tier in self._media}
        self._holders: dict[str, Counter[BlockHash]] = {tier: Counter() for tier in self._media}

    def name(self, group_id: int, first_chunk: int, keys: list[ChunkKey],
             block_hashes: Sequence[BlockHash]) -> None:
        """Remember which of a request's blocks (`block_hashes`) each of its chunks `keys`,
        from chunk `first_chunk` on, holds."""
        if group_id != self.group_id:
            return
        per_chunk = self.blocks_per_chunk
        for chunk, key in enumerate(keys, first_chunk):
            self._chunk_blocks[key] = tuple(block_hashes[chunk * per_chunk:
                                                         (chunk + 1) * per_chunk])

    def wire_events(self, moves: list[TierMoveEvent]) -> list[WireEvent]:
        """The events of `moves` whose chunks have names and that change which blocks a tier
        holds (the rest are dropped)."""
        events = (self._wire_event(move) for move in moves)
        return [event for event in events if event is not None]

    def _wire_event(self, move: TierMoveEvent) -> WireEvent | None:
        if move.destination == DEVICE:
            return None
        if move.destination is None:
            hashes = self._release(move.source, move.key)
            if not hashes:
                return None
            locality = "local" if move.source == HOST else move.locality
            medium, owner = self._media[move.source]
            return BlockRemoved(hashes, medium, self.group_id, locality, owner)
        hashes = self._hold(move.destination, move.key)
        if not hashes:
            return None
        # A move's locality is its secondary tier's; host memory is always this instance's own.
        locality = "local" if move.destination == HOST else move.locality
        medium, owner = self._media[move.destination]
        return BlockStored(hashes, None, [], self.block_size, None, medium, None,
                           group_idx=self.group_id, locality=locality, ownership=owner)

    def _hold(self, tier: str, key: ChunkKey) -> list[int]:
        """`tier` holds chunk `key` (if named): its blocks no other chunk there held."""
        blocks, held = self._chunk_blocks.get(key), self._held[tier]
        if blocks is None or key in held:
            return []
        if len(held) >= self._max_held:
            self._release(tier, next(iter(held)))  # forgotten, not announced: still there
        held[key] = blocks
        holders = self._holders[tier]
        holders.update(blocks)
        return [external_block_hash(h) for h in blocks if holders[h] == 1]

    def _release(self, tier: str, key: ChunkKey) -> list[int]:
        """`tier` no longer holds chunk `key`: its blocks no other chunk there holds."""
        blocks = self._held[tier].pop(key, None)
        holders, gone = self._holders[tier], []
        for h in blocks or ():
            holders[h] -= 1
            if not holders[h]:
                del holders[h]
                gone.append(external_block_hash(h))
        return gone
