"""Every KVCacheManager a scheduler test builds is checked for broken invariants afterwards."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from kvtier.kv import KVCacheManager

from .sched_fakes import make_manager


@pytest.fixture
def managers() -> Iterator[Callable[..., KVCacheManager]]:
    created: list[KVCacheManager] = []

    def factory(num_blocks: int, **options: object) -> KVCacheManager:
        manager = make_manager(num_blocks, **options)
        created.append(manager)
        return manager

    yield factory
    for manager in created:
        manager.check_invariants()
