"""What both halves of one OffloadingConnector share: the host area, its chunk layouts, and the
watch on promotions (the scheduler half says what its waiting requests need, the worker half's
idle wait sleeps on it).

The host area is the meeting point of the design: the scheduler half (through the tiering
manager) decides which chunk lives in which slot, the worker half copies device blocks in and
out of those slots, and the secondary tiers read and write them. The engine makes it once
(`OffloadingConnector.create_shared`) and hands it to both halves in their context; it is
process memory, so both halves run in the engine's process.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvtier.connector.base import ConnectorContext
from kvtier.kv import KVCacheSpec, MambaSpec
from kvtier.offload.config import OffloadConfig
from kvtier.offload.host_area import HostArea
from kvtier.offload.layout import ChunkLayout
from kvtier.offload.promotion_watch import PromotionWatch


@dataclass(frozen=True)
class OffloadingShared:
    area: HostArea
    # One layout per KV cache group, in group order.
    layouts: tuple[ChunkLayout, ...]
    watch: PromotionWatch = field(default_factory=PromotionWatch)


def create_offloading_shared(config: Any, context: ConnectorContext) -> OffloadingShared:
    if context.kv_cache_config is None:
        raise ValueError("OffloadingConnector needs ConnectorContext.kv_cache_config (the "
                         "engine passes its KVCacheConfig)")
    options: OffloadConfig = config.options  # parsed with the engine's config
    chunk_tokens = options.blocks_per_chunk * context.block_size
    if context.max_model_len is not None and chunk_tokens > context.max_model_len:
        raise ValueError(f"blocks_per_chunk={options.blocks_per_chunk} makes chunks of "
                         f"{chunk_tokens} tokens, longer than max_model_len="
                         f"{context.max_model_len}: no sequence would fill one, so nothing "
                         "would be offloaded; lower blocks_per_chunk")
    layouts = tuple(
        ChunkLayout(group.kv_cache_spec.page_size_bytes, len(group.layer_names),
                    chunk_blocks(group.kv_cache_spec, options.blocks_per_chunk))
        for group in context.kv_cache_config.kv_cache_groups)
    # Slots fit the largest chunk of any group, so one pool serves a hybrid model's groups.
    area = HostArea(options.cpu_bytes_to_use, max(layout.chunk_bytes for layout in layouts))
    return OffloadingShared(area, layouts)


def chunk_blocks(spec: KVCacheSpec, blocks_per_chunk: int) -> int:
    """Pages one chunk of a group holds: every block's, but for a recurrent state (Mamba) only
    the state after the chunk's last token, all a request resuming there needs."""
    return 1 if isinstance(spec, MambaSpec) else blocks_per_chunk


def shared_of(context: ConnectorContext) -> OffloadingShared:
    """The context's shared host area, or a clear error when the context was built without it."""
    if not isinstance(context.shared, OffloadingShared):
        raise ValueError("OffloadingConnector's halves need ConnectorContext.shared made by "
                         "OffloadingConnector.create_shared(config, context); got "
                         f"{context.shared!r}")
    return context.shared
