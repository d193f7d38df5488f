"""Moves between tiers, by chunk key; the offloading connector publishes them as KV events
named by the chunks' block hashes (kvtier.events), so a router can send requests where the
cache is."""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.offload.keys import ChunkKey

# Tier names used besides the configured secondary tiers' names.
DEVICE = "device"
HOST = "host"


@dataclass(frozen=True)
class TierMoveEvent:
    """Chunk `key` now has a copy in `destination`, copied from `source`. `destination` None
    means the copy in `source` was dropped (host eviction; other tiers may still hold it).
    `locality` says whether the tier that took part besides device/host is in this instance
    ("local") or elsewhere ("remote": another instance's memory, a shared object store)."""

    key: ChunkKey
    source: str
    destination: str | None
    locality: str = "local"
