"""Host-tier eviction policies, one file each, chosen by name."""

from __future__ import annotations

from kvtier.offload.policies.arc import ARCPolicy
from kvtier.offload.policies.base import EvictionPolicy
from kvtier.offload.policies.lru import LRUPolicy

POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    if name not in POLICIES:
        raise ValueError(f"eviction_policy must be one of {sorted(POLICIES)}, got {name!r}")
    return POLICIES[name](capacity)


__all__ = ["ARCPolicy", "EvictionPolicy", "LRUPolicy", "POLICIES", "make_policy"]
