"""A producer's connections to its consumers (`PeerConnections`) over real zmq engines: made in
the background, made again once closed, and not tried again within a failure's back-off."""

from __future__ import annotations

import time

import pytest

from kvtier.connector.p2p import peers as peers_module
from kvtier.connector.p2p.peers import PeerConnections
from kvtier.transport import (
    NamespaceMismatchError,
    Region,
    TransferId,
    TransportConfig,
    TransportError,
)
from kvtier.transport.zmq_engine import ZmqTransferEngine
from tests.transport.transport_helpers import NAMESPACE, OTHER_NAMESPACE, wait_results


@pytest.fixture
def engines():
    made = []

    def make(namespace: bytes = NAMESPACE, port: int = 0) -> ZmqTransferEngine:
        deadline = time.monotonic() + 5.0
        while True:
            try:
                made.append(ZmqTransferEngine(TransportConfig(namespace=namespace, port=port)))
                return made[-1]
            except TransportError:  # the port of an engine just shut down, not yet free
                assert time.monotonic() < deadline
                time.sleep(0.05)

    yield make
    for engine in made:
        engine.shutdown(timeout_s=2.0)


def test_a_consumer_restarted_at_its_address_is_connected_again(engines):
    producer, consumer = engines(), engines()
    connections = PeerConnections(producer, connect_timeout_s=5.0)
    peer = connections.get(consumer.address).result(timeout=5)
    assert connections.get(consumer.address).result() == peer  # kept while it is up
    port = int(consumer.address.rsplit(":", 1)[1])
    consumer.shutdown(timeout_s=2.0)
    restarted = engines(port=port)
    # The old connection reaches the new process, which refuses it (no handshake): it closes.
    producer.register_buffer("src", memoryview(bytearray(64)))
    producer.send(peer, TransferId("t"), [Region("src", 0, 64)], timeout_s=5)
    [result] = wait_results(producer, 1, timeout_s=5)
    assert not result.ok and not producer.is_connected(peer)
    assert connections.get(consumer.address).result(timeout=5) == restarted.engine_id


def test_a_failing_address_is_not_dialed_again_within_its_backoff(engines, monkeypatch):
    monkeypatch.setattr(peers_module, "_FIRST_BACKOFF_S", 0.3)
    producer, other = engines(), engines(OTHER_NAMESPACE)
    connections = PeerConnections(producer, connect_timeout_s=5.0)
    first = connections.get(other.address)
    with pytest.raises(NamespaceMismatchError):
        first.result(timeout=5)
    assert connections.get(other.address) is first  # fails at once: no second handshake
    assert other.stats()["refused_namespace"] == 1
    time.sleep(0.35)
    second = connections.get(other.address)
    assert second is not first
    with pytest.raises(NamespaceMismatchError):
        second.result(timeout=5)
    time.sleep(0.35)  # the back-off doubled to 0.6 s
    assert connections.get(other.address) is second
    assert other.stats()["refused_namespace"] == 2
