"""Every TieringManager a test builds through `make_manager` is shut down after the test."""

import pytest

from kvtier.offload.manager import TieringManager

from .offload_helpers import CHUNK, NAMESPACE


@pytest.fixture
def make_manager():
    managers = []

    def make(config, **kwargs):
        manager = TieringManager(config, NAMESPACE, [CHUNK], **kwargs)
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.shutdown()
