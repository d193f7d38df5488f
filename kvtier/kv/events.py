"""KV cache events: what a router needs to know about which prefixes live where.

The block pool records them (when enabled); `KVCacheManager.take_events()` drains them and fills
in the group's kind and sliding window.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.kv.hashing import BlockHash

# Medium of the paged cache the block pool manages (offload tiers name their own media).
MEDIUM_DEVICE = "device"


@dataclass(frozen=True)
class BlockStored:
    """Consecutive blocks of one request became cached, chained after `parent_block_hash`."""

    block_hashes: list[BlockHash]
    # Hash of the block before the first stored one; None when the first stored block is block 0.
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    # kvtier names LoRA adapters rather than numbering them, so the id is the adapter name.
    lora_id: str | None
    medium: str
    group_idx: int
    kind: str | None = None
    sliding_window: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    """Blocks lost their cached content (evicted for reuse or dropped after a failed load)."""

    block_hashes: list[BlockHash]
    medium: str
    group_idx: int
    kind: str | None = None
    sliding_window: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every cached hash of the medium was dropped (reset_prefix_cache)."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
