"""The standard host layout of a chunk, fixed by the KV geometry and nothing else.

A page is one block of one layer: K then V, all KV heads contiguous,
`page_bytes = 2 * block_size * num_kv_heads * head_dim * dtype_size`. A chunk is
`blocks_per_chunk` blocks x all layers of its group, block-major: page `(b, l)` sits at
`(b * num_layers + l) * page_bytes`, so the first n blocks of a chunk are one contiguous prefix.
Attention backend and parallelism do not appear, so other instances can read the bytes as-is.
A recurrent state (Mamba, LFM2's short convolutions) is described the same way with its own
`page_bytes`, and one block per chunk: the state after the chunk's last token.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.common.options import is_positive_int, require


@dataclass(frozen=True)
class ChunkLayout:
    """Byte geometry of one KV cache group's chunks."""

    page_bytes: int
    num_layers: int
    blocks_per_chunk: int

    def __post_init__(self) -> None:
        for name in ("page_bytes", "num_layers", "blocks_per_chunk"):
            require(is_positive_int(getattr(self, name)), f"ChunkLayout.{name}",
                    "must be an integer >= 1", getattr(self, name))

    @classmethod
    def for_attention(cls, block_size: int, num_kv_heads: int, head_dim: int, dtype_size: int,
                      num_layers: int, blocks_per_chunk: int) -> ChunkLayout:
        return cls(page_bytes=2 * block_size * num_kv_heads * head_dim * dtype_size,
                   num_layers=num_layers, blocks_per_chunk=blocks_per_chunk)

    @property
    def block_bytes(self) -> int:
        """All layers of one block."""
        return self.page_bytes * self.num_layers

    @property
    def chunk_bytes(self) -> int:
        return self.block_bytes * self.blocks_per_chunk

    def page_offset(self, block_in_chunk: int, layer: int) -> int:
        return (block_in_chunk * self.num_layers + layer) * self.page_bytes
