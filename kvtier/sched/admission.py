"""How a waiting request would start: its prefix hits (local, then external) and its first
chunk."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from kvtier.connector.base import KVConnectorScheduler
    from kvtier.kv import KVCacheBlocks, KVCacheManager, Request


@dataclass(frozen=True)
class Admission:
    # Local prefix-cache hit (None for a request already holding its blocks).
    computed_blocks: KVCacheBlocks | None
    num_local_tokens: int
    num_external_tokens: int
    # The external tokens arrive asynchronously: compute nothing until they land.
    load_async: bool
    num_new_tokens: int

    @property
    def num_computed_tokens(self) -> int:
        return self.num_local_tokens + self.num_external_tokens


def plan_admission(request: Request, kv_cache_manager: KVCacheManager,
                   connector: KVConnectorScheduler | None, token_budget: int, *,
                   enable_chunked_prefill: bool, ask_connector: bool) -> Admission | None:
    """The admission `request` would get now; None when the connector cannot tell yet."""
    if request.num_computed_tokens > 0:
        # Promoted after a load: it holds its blocks and knows its computed tokens.
        computed_blocks, num_local, num_external, load_async = None, 0, 0, False
        num_computed = request.num_computed_tokens
    else:
        computed_blocks, num_local = kv_cache_manager.get_computed_blocks(request)
        num_external, load_async = 0, False
        if connector is not None and ask_connector:
            answer, load_async = connector.get_num_new_matched_tokens(request, num_local)
            if request.skip_reading_prefix_cache:
                # Asked all the same, so the connector knows the request (a P/D producer
                # holding its blocks for it learns to let them go); nothing is loaded.
                answer, load_async = 0, False
            if answer is None:
                return None
            num_external = _usable_external_tokens(request, kv_cache_manager, num_local, answer,
                                                   load_async)
            load_async = load_async and num_external > 0
        num_computed = num_local + num_external
    if load_async:
        num_new = 0
    else:
        num_new = request.num_tokens - num_computed
        if enable_chunked_prefill:
            num_new = min(num_new, token_budget)
    return Admission(computed_blocks, num_local, num_external, load_async, num_new)


def _usable_external_tokens(request: Request, kv_cache_manager: KVCacheManager, num_local: int,
                            num_external: int, load_async: bool) -> int:
    """The connector's `num_external` tokens cut to what the request can go on from."""
    alignment = kv_cache_manager.hit_alignment_tokens
    if not load_async or alignment > 1:
        # The last token is always computed: its logits give the next token. (A full-attention
        # async load may bring it along; it is computed again once the load lands.)
        num_external = min(num_external, request.num_tokens - 1 - num_local)
    # A state or window group resumes only on a block boundary, where its blocks end; cut
    # after loading the whole prompt, it would read a state or window of the wrong length.
    return num_external - (num_local + num_external) % alignment
