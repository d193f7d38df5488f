"""KV cache specs: page sizes, kinds and validation."""

from __future__ import annotations

import pytest

from kvtier.kv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)


def test_page_sizes():
    assert FullAttentionSpec(16, num_kv_heads=2, head_size=64).page_size_bytes == 8192
    assert SlidingWindowSpec(16, 2, 64, 4, sliding_window=128).page_size_bytes == 16384
    assert MambaSpec(16, ((4, 8), (3,)), 4).page_size_bytes == 140


def test_kinds_in_group_order():
    cfg = KVCacheConfig(4, [KVCacheGroupSpec(["a"], FullAttentionSpec(4, 1, 8)),
                            KVCacheGroupSpec(["b"], SlidingWindowSpec(4, 1, 8, sliding_window=8)),
                            KVCacheGroupSpec(["c"], MambaSpec(4, ((2,),)))])
    assert cfg.spec_kinds == ("full_attention", "sliding_window", "mamba")


@pytest.mark.parametrize("build, field", [
    (lambda: FullAttentionSpec(0, 1, 8), "block_size"),
    (lambda: FullAttentionSpec(-4, 1, 8), "block_size"),
    (lambda: FullAttentionSpec(4, 0, 8), "num_kv_heads"),
    (lambda: SlidingWindowSpec(4, 1, 8, sliding_window=0), "sliding_window"),
    (lambda: SlidingWindowSpec(4, 1, 8, sliding_window=-1), "sliding_window"),
    (lambda: MambaSpec(4, ()), "state_shapes"),
    (lambda: MambaSpec(0, ((2,),)), "block_size"),
    (lambda: KVCacheConfig(1, [KVCacheGroupSpec(["a"], FullAttentionSpec(4, 1, 8))]),
     "num_blocks"),
    (lambda: KVCacheConfig(4, []), "kv_cache_groups"),
])
def test_bad_specs_name_the_field(build, field):
    with pytest.raises(ValueError, match=field):
        build()


def test_unsupported_spec_type_is_rejected():
    from kvtier.kv import KVCacheManager, KVCacheSpec

    class Unknown(KVCacheSpec):
        pass

    with pytest.raises(ValueError, match="unsupported type Unknown"):
        KVCacheManager(KVCacheConfig(4, [KVCacheGroupSpec(["a"], Unknown(4))]), 64)
