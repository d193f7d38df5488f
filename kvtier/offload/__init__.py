"""Tiered KV offloading as pure bytes: host area, eviction policies, tiering manager, tiers.

No torch here: the device side lives in kvtier/connector/offloading (the worker half).
"""

from kvtier.offload.config import OffloadConfig, TierSpec, parse_kv_offload
from kvtier.offload.events import TierMoveEvent
from kvtier.offload.keys import ChunkKey, make_chunk_key
from kvtier.offload.layout import ChunkLayout
from kvtier.offload.manager import Lookup, TieringManager

__all__ = ["ChunkKey", "ChunkLayout", "Lookup", "OffloadConfig", "TierMoveEvent", "TierSpec",
           "TieringManager", "make_chunk_key", "parse_kv_offload"]
