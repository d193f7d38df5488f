"""Every TieringManager a test builds through `make_manager` is shut down after the test."""

import pytest

from kvtier.offload.host_area import HostArea
from kvtier.offload.manager import TieringManager

from .offload_helpers import CHUNK, NAMESPACE


@pytest.fixture
def make_manager():
    managers = []

    def make(config, **kwargs):
        area = HostArea(config.cpu_bytes_to_use, CHUNK)
        manager = TieringManager(config, NAMESPACE, area, **kwargs)
        managers.append(manager)
        return manager

    yield make
    for manager in managers:
        manager.shutdown()
