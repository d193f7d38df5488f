"""Every TieringManager a test builds through `make_manager` is shut down after the test; a
Valkey server and a Valkey cluster per test module that asks for one (`single`, `cluster`)."""

import pytest

from kvtier.offload.host_area import HostArea
from kvtier.offload.manager import TieringManager

from ..stores import ValkeyCluster, ValkeyServer
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


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    with ValkeyServer(tmp_path_factory.mktemp("valkey")) as server:
        yield server


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    with ValkeyCluster(tmp_path_factory.mktemp("valkey-cluster")) as servers:
        yield servers
