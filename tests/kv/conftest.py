"""Every KVCacheManager a test builds through `make_manager` is invariant-checked when the
test ends."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvtier.kv import KVCacheManager, KVCacheSpec

from .kv_helpers import config


@pytest.fixture
def make_manager() -> Iterator[Callable[..., KVCacheManager]]:
    """Build managers; each one's invariants are checked after the test body."""
    built: list[KVCacheManager] = []

    def build(num_blocks: int = 11, *specs: KVCacheSpec, **kwargs) -> KVCacheManager:
        kwargs.setdefault("max_model_len", 4096)
        kwargs.setdefault("watermark", 0.0)
        manager = KVCacheManager(config(num_blocks, *specs), **kwargs)
        built.append(manager)
        return manager

    yield build
    for manager in built:
        manager.check_invariants()
