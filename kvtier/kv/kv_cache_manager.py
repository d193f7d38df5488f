"""KVCacheManager: the KV cache as the scheduler sees it.

A thin facade: per-request block tables live in the per-group managers, blocks in the BlockPool.
Token layout of a request during `allocate_slots`:

    | computed | new computed (local hit) | external computed | new | lookahead |
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvtier.kv.block_pool import BlockPool, KVCacheBlock
from kvtier.kv.coordinator import get_kv_cache_coordinator
from kvtier.kv.events import AllBlocksCleared, KVCacheEvent
from kvtier.kv.hashing import get_hash_function, make_block_hasher
from kvtier.kv.invariants import check_manager_invariants
from kvtier.kv.request import RequestStatus
from kvtier.kv.specs import KVCacheConfig, SlidingWindowSpec
from kvtier.kv.stats import PrefixCacheStats

if TYPE_CHECKING:
    from kvtier.kv.hashing import BlockHash
    from kvtier.kv.request import Request

_WATERMARKED_STATUSES = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


@dataclass(frozen=True)
class KVCacheBlocks:
    """Result handed to the scheduler: `blocks[i][j]` is the j-th block of group i."""

    blocks: tuple[Sequence[KVCacheBlock], ...]

    def __add__(self, other: KVCacheBlocks) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(list(a) + list(b) for a, b in zip(self.blocks, other.blocks)))

    def get_block_ids(self) -> tuple[list[int], ...]:
        return tuple([block.block_id for block in group] for group in self.blocks)

    def get_unhashed_block_ids(self) -> list[int]:
        """Ids of group 0's blocks that are not in the prefix map (e.g. to be filled by a load)."""
        return [block.block_id for block in self.blocks[0] if block.cache_key is None]

    def new_empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple(() for _ in self.blocks))

    def is_empty(self) -> bool:
        return not any(self.blocks)


class KVCacheManager:
    """Allocates, caches and frees the blocks of every request over all KV cache groups."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int,
                 enable_caching: bool = True, hash_algo: str = "sha256_cbor",
                 enable_kv_cache_events: bool = False, watermark: float = 0.01) -> None:
        if max_model_len <= 0:
            raise ValueError(f"max_model_len must be > 0, got {max_model_len}")
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        get_hash_function(hash_algo)  # fail at start-up, not on the first request
        self.kv_cache_config = kv_cache_config
        self.max_model_len = max_model_len
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self.enable_kv_cache_events = enable_kv_cache_events
        self.watermark_blocks = int(watermark * kv_cache_config.num_blocks)
        self.coordinator = get_kv_cache_coordinator(kv_cache_config, enable_caching,
                                                    enable_kv_cache_events)
        self.block_pool: BlockPool = self.coordinator.block_pool
        self.num_kv_cache_groups = len(kv_cache_config.kv_cache_groups)
        # One shared "no blocks" result: most decode steps allocate nothing.
        self.empty_kv_cache_blocks = KVCacheBlocks(self.coordinator.empty_blocks)
        self.prefix_cache_stats = PrefixCacheStats()
        # Blocks handed out by pop_blocks_for_free and not yet freed: block id -> count.
        self._detached_blocks: Counter[int] = Counter()

    # ---- facts -----------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        """Tokens per hash block: the block size a Request's block hasher must use."""
        return self.coordinator.hash_block_size

    @property
    def hit_alignment_tokens(self) -> int:
        """Tokens a prefix hit's length (local, or with a connector's external tokens) must be
        a multiple of: 1 when every group is full attention; else the groups' block sizes'
        LCM, since a recurrent state exists only at block ends and a sliding window drops
        whole blocks (the local hit is already cut this way)."""
        coordinator = self.coordinator
        return coordinator.alignment_tokens if coordinator.skips_blocks else 1

    @property
    def usage(self) -> float:
        return self.block_pool.get_usage()

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.get_num_free_blocks()

    def make_block_hasher(self) -> Callable[[Request], list[BlockHash]]:
        """The block hasher the engine passes to every Request it builds for this manager."""
        return make_block_hasher(self.block_size, self.hash_algo)

    # ---- prefix hits -------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of `request` and its length in tokens.

        Capped at num_tokens - 1: the last token is always recomputed to produce logits.
        """
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return self.empty_kv_cache_blocks, 0
        hit_blocks, num_hit_tokens = self.coordinator.find_longest_cache_hit(
            request.block_hashes, request.num_tokens - 1)
        if request.prefix_lookup_counted != request.num_preemptions:
            request.prefix_lookup_counted = request.num_preemptions
            self.prefix_cache_stats.record(request.num_tokens, num_hit_tokens,
                                           preempted=request.num_preemptions > 0)
        return self.create_kv_cache_blocks(hit_blocks), num_hit_tokens

    # ---- allocation --------------------------------------------------------------------------

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       num_new_computed_tokens: int = 0,
                       new_computed_blocks: KVCacheBlocks | None = None,
                       num_lookahead_tokens: int = 0, num_external_computed_tokens: int = 0,
                       delay_cache_blocks: bool = False, full_sequence_must_fit: bool = False,
                       reserved_blocks: int = 0) -> KVCacheBlocks | None:
        """Give `request` slots for its new (and external, and lookahead) tokens.

        Returns the block-table entries appended by this call, per group (the local hit
        blocks passed in are not repeated), or None when the blocks do not fit; None leaves
        the manager exactly as it was.
        """
        if (num_new_tokens <= 0 or num_new_computed_tokens < 0 or num_lookahead_tokens < 0
                or num_external_computed_tokens < 0 or reserved_blocks < 0):
            _check_allocate_args(num_new_tokens, num_new_computed_tokens, num_lookahead_tokens,
                                 num_external_computed_tokens, reserved_blocks)
        request_id = request.request_id
        hit_blocks = (self.coordinator.empty_blocks if new_computed_blocks is None
                      else new_computed_blocks.blocks)
        num_local_computed = request.num_computed_tokens + num_new_computed_tokens
        num_computed = num_local_computed + num_external_computed_tokens
        num_slots = min(num_computed + num_new_tokens + num_lookahead_tokens,
                        self.max_model_len)
        if not self._fits(request, num_slots, hit_blocks, num_computed, full_sequence_must_fit,
                          reserved_blocks):
            return None

        coordinator = self.coordinator
        # Drop blocks outside sliding windows first: fewer evictions of cached blocks.
        coordinator.remove_skipped_blocks(request_id, num_computed)
        if hit_blocks is not coordinator.empty_blocks and any(hit_blocks):
            coordinator.save_new_computed_blocks(request_id, hit_blocks, num_computed)
        new_blocks = coordinator.allocate_new_blocks(request_id, num_slots, num_computed)

        # An async load has not landed yet: caching now would hand other requests garbage.
        if self.enable_caching and not delay_cache_blocks:
            coordinator.cache_blocks(request,
                                     min(num_computed + num_new_tokens, request.num_tokens))
        return self.create_kv_cache_blocks(new_blocks)

    def _fits(self, request: Request, num_slots: int,
              hit_blocks: tuple[Sequence[KVCacheBlock], ...], num_computed: int,
              full_sequence_must_fit: bool, reserved_blocks: int) -> bool:
        """Whether the allocation fits, counting blocks the window skip will free as free."""
        coordinator = self.coordinator
        request_id = request.request_id
        available = (self.block_pool.get_num_free_blocks() - reserved_blocks
                     + coordinator.count_freeable_skipped_blocks(request_id, num_computed))
        num_required = coordinator.get_num_blocks_to_allocate(request_id, num_slots, hit_blocks,
                                                              num_computed)
        # A newcomer must not take the last blocks that half-finished requests will need.
        if (request.status in _WATERMARKED_STATUSES
                and coordinator.num_requests_holding_blocks()
                > coordinator.holds_request(request_id)):
            num_required += self.watermark_blocks
            watermarked = True
        else:
            watermarked = False
        if num_required > available:
            return False
        if not full_sequence_must_fit:
            return True
        # Admission: the whole known sequence must fit, or chunked prefill would get stuck.
        num_full = min(max(request.num_tokens, num_slots), self.max_model_len)
        num_required_full = coordinator.get_num_blocks_to_allocate(request_id, num_full,
                                                                   hit_blocks, num_computed)
        if watermarked:
            num_required_full += self.watermark_blocks
        return num_required_full <= available

    def num_blocks_to_finish_prefill(self, request: Request) -> int:
        """Blocks `request` must still be given for all its known tokens (the prompt, and
        what it generated before a preemption) beyond the ones it holds."""
        num_tokens = min(request.num_tokens, self.max_model_len)
        return self.coordinator.get_num_blocks_to_allocate(
            request.request_id, num_tokens, self.coordinator.empty_blocks,
            request.num_computed_tokens)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Put the request's blocks that are full within `num_computed_tokens` into the prefix
        map (after a delayed load landed)."""
        if self.enable_caching:
            self.coordinator.cache_blocks(request, num_computed_tokens)

    def resumable_tokens(self, request: Request, num_tokens: int) -> int:
        """Where `request` can go on when its tokens from `num_tokens` on must be recomputed:
        `num_tokens`, or 0 when a group no longer holds what it needs there (a recurrent state
        is kept only for the latest block, a sliding window drops older blocks); then the
        request must start over with fresh blocks."""
        return self.coordinator.resumable_tokens(request.request_id, num_tokens)

    # ---- release -----------------------------------------------------------------------------

    def free(self, request: Request) -> None:
        """Release all blocks of `request`, last block first, so its tail is evicted first."""
        self.coordinator.free(request.request_id)

    def pop_blocks_for_free(self, request: Request) -> list[KVCacheBlock]:
        """Forget `request` but keep its blocks allocated (a transfer still reads them).

        Returns the blocks already in free order; the caller must later pass them, unchanged,
        to `free_popped_blocks`.
        """
        blocks = self.coordinator.pop_blocks(request.request_id)
        self._detached_blocks.update(b.block_id for b in blocks if not b.is_null)
        return blocks

    def free_popped_blocks(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Free blocks returned by `pop_blocks_for_free`, in the order given."""
        detached = self._detached_blocks
        for block in blocks:
            if block.is_null:
                continue
            if detached[block.block_id] <= 0:
                raise ValueError(f"block {block.block_id} was not popped by pop_blocks_for_free")
            detached[block.block_id] -= 1
            if detached[block.block_id] == 0:
                del detached[block.block_id]
        self.block_pool.free_blocks(blocks)

    def evict_blocks(self, block_ids: set[int] | Sequence[int]) -> None:
        """Drop these blocks from the prefix cache (their load failed: content is invalid)."""
        self.block_pool.evict_blocks(block_ids)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix; False (nothing done) while any block is in use."""
        if not self.block_pool.reset_prefix_cache():
            return False
        self.prefix_cache_stats.reset = True
        return True

    # ---- views -------------------------------------------------------------------------------

    def get_blocks(self, request_id: str) -> KVCacheBlocks:
        return KVCacheBlocks(self.coordinator.get_blocks(request_id))

    def get_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return self.get_blocks(request_id).get_block_ids()

    def has_every_usable_block(self, request_id: str) -> bool:
        """The request's blocks and the free ones are all there are: it can never get more."""
        null_id = self.block_pool.null_block.block_id
        held = {b for ids in self.get_block_ids(request_id) for b in ids} - {null_id}
        usable = self.kv_cache_config.num_blocks - 1  # the null block is never handed out
        return len(held) + self.num_free_blocks >= usable

    def create_kv_cache_blocks(self, blocks: tuple[Sequence[KVCacheBlock], ...]) -> KVCacheBlocks:
        """Wrap per-group blocks; the shared empty instance when there are none."""
        return KVCacheBlocks(blocks) if any(blocks) else self.empty_kv_cache_blocks

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Stats since the last call; the counters restart at zero."""
        stats, self.prefix_cache_stats = self.prefix_cache_stats, PrefixCacheStats()
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        """Drain the block pool's events, tagged with their group's kind and sliding window."""
        events = self.block_pool.take_events()
        if not events:
            return events
        groups = self.kv_cache_config.kv_cache_groups
        tagged: list[KVCacheEvent] = []
        for event in events:
            if isinstance(event, AllBlocksCleared):
                tagged.append(event)
                continue
            spec = groups[event.group_idx].kv_cache_spec
            window = spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None
            tagged.append(dataclasses.replace(event, kind=spec.kind, sliding_window=window))
        return tagged

    def check_invariants(self, active_request_ids: set[str] | None = None) -> None:
        """Raise AssertionError naming the first broken invariant (see invariants.py)."""
        check_manager_invariants(self.coordinator, self._detached_blocks, active_request_ids)


def _check_allocate_args(num_new_tokens: int, num_new_computed_tokens: int,
                         num_lookahead_tokens: int, num_external_computed_tokens: int,
                         reserved_blocks: int) -> None:
    """Slow path of allocate_slots' argument check: raise naming the bad argument."""
    for name, value in (("num_new_tokens", num_new_tokens),
                        ("num_new_computed_tokens", num_new_computed_tokens),
                        ("num_lookahead_tokens", num_lookahead_tokens),
                        ("num_external_computed_tokens", num_external_computed_tokens),
                        ("reserved_blocks", reserved_blocks)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    if num_new_tokens == 0 and num_external_computed_tokens == 0:
        raise ValueError("num_new_tokens must be > 0 unless num_external_computed_tokens > 0")
