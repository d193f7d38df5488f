"""KV cache specs: what one block of one layer group holds, and how groups share the pool."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class KVCacheSpec:
    """Base of every spec: one block covers `block_size` token positions."""

    block_size: int
    # Short stable name of the spec type; used in events and in the namespace digest.
    kind: ClassVar[str] = "abstract"

    def __post_init__(self) -> None:
        _require_positive(type(self).__name__, "block_size", self.block_size)

    @property
    def page_size_bytes(self) -> int:
        """Bytes one block of one layer occupies."""
        raise NotImplementedError(f"{type(self).__name__} must define page_size_bytes")


@dataclass(frozen=True)
class AttentionSpec(KVCacheSpec):
    """Paged K and V for every token position of a block."""

    num_kv_heads: int
    head_size: int
    dtype_size: int = 2

    def __post_init__(self) -> None:
        super().__post_init__()
        name = type(self).__name__
        _require_positive(name, "num_kv_heads", self.num_kv_heads)
        _require_positive(name, "head_size", self.head_size)
        _require_positive(name, "dtype_size", self.dtype_size)

    @property
    def page_size_bytes(self) -> int:
        # K and V: 2 * (block_size, num_kv_heads, head_size) elements.
        return 2 * self.block_size * self.num_kv_heads * self.head_size * self.dtype_size


@dataclass(frozen=True)
class FullAttentionSpec(AttentionSpec):
    """Every token attends to every earlier token: all blocks stay needed."""

    kind: ClassVar[str] = "full_attention"


@dataclass(frozen=True)
class SlidingWindowSpec(AttentionSpec):
    """Each token attends to the last `sliding_window` tokens (itself included)."""

    sliding_window: int = field(kw_only=True)
    kind: ClassVar[str] = "sliding_window"

    def __post_init__(self) -> None:
        super().__post_init__()
        _require_positive("SlidingWindowSpec", "sliding_window", self.sliding_window)


@dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    """One recurrent state per request; a block holds the state after its last token."""

    state_shapes: tuple[tuple[int, ...], ...]
    dtype_size: int = 2
    kind: ClassVar[str] = "mamba"

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.state_shapes or any(d <= 0 for shape in self.state_shapes for d in shape):
            raise ValueError("MambaSpec.state_shapes must be a non-empty tuple of shapes with "
                             f"positive dimensions, got {self.state_shapes!r}")
        _require_positive("MambaSpec", "dtype_size", self.dtype_size)

    @property
    def page_size_bytes(self) -> int:
        return sum(math.prod(shape) for shape in self.state_shapes) * self.dtype_size


@dataclass(frozen=True)
class KVCacheGroupSpec:
    """Layers that share one spec and therefore one block table per request."""

    layer_names: list[str]
    kv_cache_spec: KVCacheSpec


@dataclass(frozen=True)
class KVCacheConfig:
    """How many blocks the shared pool has and which layer groups draw from it.

    Block 0 is the null block, so at least 2 blocks are needed for any allocation.
    """

    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]

    def __post_init__(self) -> None:
        if self.num_blocks < 2:
            raise ValueError(f"KVCacheConfig.num_blocks must be >= 2 (block 0 is the null "
                             f"block), got {self.num_blocks}")
        if not self.kv_cache_groups:
            raise ValueError("KVCacheConfig.kv_cache_groups must name at least one group")

    @property
    def spec_kinds(self) -> tuple[str, ...]:
        """The kind of each group, in group order (an input of the namespace digest)."""
        return tuple(g.kv_cache_spec.kind for g in self.kv_cache_groups)


def _require_positive(owner: str, name: str, value: int) -> None:
    if value <= 0:
        raise ValueError(f"{owner}.{name} must be > 0, got {value}")
