"""Tier moves as KV events: each chunk named by its blocks' hashes, so that a router indexing
the engine's events learns which blocks host memory and each secondary tier hold.

Loads into the device are left out: the device cache publishes those blocks itself.
"""

from __future__ import annotations

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
        """The events of `moves` whose chunks have names (the rest are dropped)."""
        events = (self._wire_event(move) for move in moves)
        return [event for event in events if event is not None]

    def _wire_event(self, move: TierMoveEvent) -> WireEvent | None:
        blocks = self._chunk_blocks.get(move.key)
        if blocks is None or move.destination == DEVICE:
            return None
        hashes = [external_block_hash(h) for h in blocks]
        # A move's locality is its secondary tier's; host memory is always this instance's own.
        if move.destination is None:
            locality = "local" if move.source == HOST else move.locality
            medium, owner = self._media[move.source]
            return BlockRemoved(hashes, medium, self.group_id, locality, owner)
        locality = "local" if move.destination == HOST else move.locality
        medium, owner = self._media[move.destination]
        return BlockStored(hashes, None, [], self.block_size, None, medium, None,
                           group_idx=self.group_id, locality=locality, ownership=owner)
