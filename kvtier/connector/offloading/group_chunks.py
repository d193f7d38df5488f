"""Which chunks, and which of their blocks, each KV cache group of a model needs.

A full-attention group needs every chunk of a hit, a sliding-window group only the chunks its
window reaches at the end of the hit, a Mamba group only the last one (whose host chunk is the
single state after its last token, at offset 0). Blocks the device cache has already replaced by
the null block (outside a sliding window) are never copied.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvtier.kv import FullAttentionSpec, MambaSpec, SlidingWindowSpec
from kvtier.offload.layout import ChunkLayout

_NULL_BLOCK_ID = 0


class GroupChunks:
    def __init__(self, specs: Sequence[object], layouts: Sequence[ChunkLayout], block_size: int,
                 blocks_per_chunk: int) -> None:
        self.specs = list(specs)
        self.layouts = layouts
        self.blocks_per_chunk = blocks_per_chunk
        self.chunk_tokens = block_size * blocks_per_chunk

    def __len__(self) -> int:
        return len(self.specs)

    def scan_groups(self) -> list[int]:
        """The groups a lookup walks chunk by chunk: the full-attention ones (or the first)."""
        full = [g for g, spec in enumerate(self.specs) if isinstance(spec, FullAttentionSpec)]
        return full or [0]

    def needed(self, group_id: int, start: int, end: int) -> range:
        """Chunks of [start, end) that `group_id` needs to continue from chunk `end`."""
        spec = self.specs[group_id]
        if isinstance(spec, SlidingWindowSpec):
            first_token = max(0, end * self.chunk_tokens - spec.sliding_window + 1)
            return range(max(start, first_token // self.chunk_tokens), end)
        if isinstance(spec, MambaSpec):
            return range(max(start, end - 1), end)
        return range(start, end)

    def blocks_of_chunk(self, group_id: int, chunk: int, block_ids: list[int], first_block: int,
                        end_block: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(offsets in the chunk, device block ids) of the chunk's blocks in
        [first_block, end_block), leaving out null blocks. A recurrent-state chunk holds only
        its last block's state, at offset 0."""
        per_chunk = self.blocks_per_chunk
        first_index = chunk * per_chunk
        if isinstance(self.specs[group_id], MambaSpec):
            first_index = (chunk + 1) * per_chunk - 1
        offsets, ids = [], []
        for offset in range(self.layouts[group_id].blocks_per_chunk):
            index = first_index + offset
            if first_block <= index < min(end_block, len(block_ids)) \
                    and block_ids[index] != _NULL_BLOCK_ID:
                offsets.append(offset)
                ids.append(block_ids[index])
        return tuple(offsets), tuple(ids)
