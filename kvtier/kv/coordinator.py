"""Coordinators: drive every group's manager together so all groups agree on one prefix hit.

* `UnitaryKVCacheCoordinator`: one group, its hit is the answer.
* `HybridKVCacheCoordinator`: several groups; the hit length shrinks until every group accepts
  it (a fixed point), in multiples of the LCM of the groups' block sizes.
* `KVCacheCoordinatorNoPrefixCache`: caching off; never a hit, never caches.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvtier.kv.block_pool import BlockPool, KVCacheBlock
from kvtier.kv.managers import SingleTypeKVCacheManager, get_manager_for_kv_cache_spec
from kvtier.kv.specs import KVCacheConfig

if TYPE_CHECKING:
    from kvtier.kv.hashing import BlockHash
    from kvtier.kv.request import Request

BlocksPerGroup = tuple[Sequence[KVCacheBlock], ...]


class KVCacheCoordinator(ABC):
    """Fans each operation out to the per-group managers over one shared BlockPool."""

    def __init__(self, kv_cache_config: KVCacheConfig, enable_caching: bool,
                 enable_kv_cache_events: bool) -> None:
        self.kv_cache_config = kv_cache_config
        block_sizes = [g.kv_cache_spec.block_size for g in kv_cache_config.kv_cache_groups]
        # Request hashes are cut at the GCD so every group's block ends on a hash boundary.
        self.hash_block_size = math.gcd(*block_sizes)
        # A hit must end on a block boundary of every group.
        self.alignment_tokens = math.lcm(*block_sizes)
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching,
                                    enable_kv_cache_events)
        self.managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            get_manager_for_kv_cache_spec(group.kv_cache_spec, self.block_pool, group_id,
                                          self.hash_block_size)
            for group_id, group in enumerate(kv_cache_config.kv_cache_groups))
        self._skipping_managers = tuple(m for m in self.managers if m.skips_blocks)
        # A group drops blocks (sliding window, recurrent state): hits must be block-aligned.
        self.skips_blocks = bool(self._skipping_managers)
        self.empty_blocks: BlocksPerGroup = tuple(() for _ in self.managers)

    @abstractmethod
    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_length: int) -> tuple[BlocksPerGroup, int]:
        """Per-group hit blocks and the hit length in tokens, at most `max_length`."""

    def get_num_blocks_to_allocate(self, request_id: str, num_tokens: int,
                                   new_computed_blocks: BlocksPerGroup,
                                   num_computed_tokens: int) -> int:
        total = 0
        for manager, hit_blocks in zip(self.managers, new_computed_blocks):
            total += manager.get_num_blocks_to_allocate(request_id, num_tokens, hit_blocks,
                                                        num_computed_tokens)
        return total

    def count_freeable_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> int:
        total = 0
        for manager in self._skipping_managers:
            total += manager.count_freeable_skipped_blocks(request_id, num_computed_tokens)
        return total

    def remove_skipped_blocks(self, request_id: str, num_computed_tokens: int) -> None:
        for manager in self._skipping_managers:
            manager.remove_skipped_blocks(request_id, num_computed_tokens)

    def resumable_tokens(self, request_id: str, num_tokens: int) -> int:
        """`num_tokens` if every group can go on from there with the blocks it holds, else 0."""
        for manager in self._skipping_managers:
            if not manager.can_resume_at(request_id, num_tokens):
                return 0
        return num_tokens

    def save_new_computed_blocks(self, request_id: str, new_computed_blocks: BlocksPerGroup,
                                 num_computed_tokens: int) -> None:
        for manager, hit_blocks in zip(self.managers, new_computed_blocks):
            manager.save_new_computed_blocks(request_id, hit_blocks, num_computed_tokens)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_computed_tokens: int) -> tuple[list[KVCacheBlock], ...]:
        # A list comprehension, not a generator: this runs for every request every step.
        return tuple([m.allocate_new_blocks(request_id, num_tokens, num_computed_tokens)
                      for m in self.managers])

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        for manager in self.managers:
            manager.cache_blocks(request, num_tokens)

    def free(self, request_id: str) -> None:
        for manager in self.managers:
            manager.free(request_id)

    def pop_blocks(self, request_id: str) -> list[KVCacheBlock]:
        """Every group's blocks of the request, each group's last block first."""
        popped: list[KVCacheBlock] = []
        for manager in self.managers:
            popped.extend(manager.pop_blocks(request_id))
        return popped

    def get_blocks(self, request_id: str) -> BlocksPerGroup:
        return tuple(m.req_to_blocks.get(request_id, ()) for m in self.managers)

    def num_requests_holding_blocks(self) -> int:
        return len(self.managers[0].req_to_blocks)

    def holds_request(self, request_id: str) -> bool:
        return request_id in self.managers[0].req_to_blocks


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_length: int) -> tuple[BlocksPerGroup, int]:
        return self.empty_blocks, 0

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        return None


class UnitaryKVCacheCoordinator(KVCacheCoordinator):

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_length: int) -> tuple[BlocksPerGroup, int]:
        manager = self.managers[0]
        hits = manager.find_longest_cache_hit(block_hashes, max_length, manager.block_size)
        return (hits,), len(hits) * manager.block_size


class HybridKVCacheCoordinator(KVCacheCoordinator):

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_length: int) -> tuple[BlocksPerGroup, int]:
        alignment = self.alignment_tokens
        hit_length = max_length - max_length % alignment
        hits: list[list[KVCacheBlock]] = [[] for _ in self.managers]
        # Each group can only shrink the length; once a full pass shrinks nothing, every group's
        # hit was computed for the final length, so all lists agree with it.
        while True:
            start_length = hit_length
            for group_id, manager in enumerate(self.managers):
                hits[group_id] = manager.find_longest_cache_hit(block_hashes, hit_length,
                                                                alignment)
                hit_length = min(hit_length, len(hits[group_id]) * manager.block_size)
            if hit_length == start_length:
                return tuple(hits), hit_length


def get_kv_cache_coordinator(kv_cache_config: KVCacheConfig, enable_caching: bool,
                             enable_kv_cache_events: bool) -> KVCacheCoordinator:
    if not enable_caching:
        coordinator_cls: type[KVCacheCoordinator] = KVCacheCoordinatorNoPrefixCache
    elif len(kv_cache_config.kv_cache_groups) == 1:
        coordinator_cls = UnitaryKVCacheCoordinator
    else:
        coordinator_cls = HybridKVCacheCoordinator
    return coordinator_cls(kv_cache_config, enable_caching, enable_kv_cache_events)
