"""What a zmq engine keeps for peers that are not (yet) trusted, and how much of it: frames no
larger than the protocol sends, handshakes under way bounded without ever dropping others'
because of connections that finished theirs, malformed messages remembered and logged within
bounds."""

from __future__ import annotations

import logging
import struct

import pytest
import zmq

from kvtier.transport import TransportConfig, protocol, zmq_loop, zmq_state
from kvtier.transport.base import MalformedMessageError
from kvtier.transport.handshake import Dialing, LocalIdentity
from kvtier.transport.zmq_engine import ZmqTransferEngine
from kvtier.transport.zmq_state import MalformedLog
from tests.transport.transport_helpers import (
    NAMESPACE,
    OTHER_NAMESPACE,
    wait_until,
    zmtp_dealer,
)


@pytest.fixture
def engines():
    made = []

    def make(**options) -> ZmqTransferEngine:
        made.append(ZmqTransferEngine(TransportConfig(namespace=NAMESPACE, **options)))
        return made[-1]

    yield make
    for engine in made:
        engine.shutdown(timeout_s=2.0)


def _disconnected(conn) -> bool:
    """Whether the engine closed a raw connection (within its 5 s timeout)."""
    try:
        while conn.recv(4096):
            pass  # the engine's own greeting and READY
    except ConnectionResetError:
        pass
    except TimeoutError:
        return False
    return True


def test_a_frame_larger_than_the_protocol_sends_drops_the_peer_before_the_handshake(engines):
    engine = engines()
    assert engine.config.max_frame_bytes == protocol.MAX_FRAME_BYTES == 4 << 20
    conn = zmtp_dealer(engine.address)
    # A long frame (flags: more, long) announcing 8 MiB: zmq drops the connection on the
    # announcement, before it allocates anything for it.
    conn.sendall(b"\x03" + struct.pack(">Q", 8 << 20) + bytes(1 << 16))
    assert _disconnected(conn)
    conn.close()
    with pytest.raises(ValueError, match="max_frame_bytes must be >="):
        TransportConfig(namespace=NAMESPACE, max_frame_bytes=1 << 20)


def _hello(ctx: zmq.Context, address: str, name: str) -> tuple[zmq.Socket, Dialing, dict]:
    """A raw peer that said hello: (its socket, its side of the handshake, the reply)."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.RCVTIMEO, 5000)
    dealer.connect(address)
    dialing = Dialing(LocalIdentity(name, NAMESPACE.hex(), None), address)
    dealer.send(dialing.hello())
    return dealer, dialing, protocol.decode(dealer.recv())


def _prove(dealer: zmq.Socket, dialing: Dialing, ack: dict) -> str:
    """Finish a raw peer's handshake; the engine's answer ("welcome" or "refused")."""
    proof, _ = dialing.on_hello_ack(ack)
    dealer.send(proof)
    return protocol.decode(dealer.recv())["t"]


def test_finished_handshakes_never_push_out_one_under_way(engines, monkeypatch):
    monkeypatch.setattr(zmq_loop, "MAX_HANDSHAKES", 2)
    receiver, dialer = engines(), engines()
    for _ in range(5):  # each connect replaces the last: five handshakes that finished
        dialer.connect(receiver.address, timeout_s=5)
    ctx = zmq.Context()
    try:
        a = _hello(ctx, receiver.address, "a")
        b = _hello(ctx, receiver.address, "b")
        assert _prove(*a) == "welcome"  # b's hello did not drop a's handshake
        c = _hello(ctx, receiver.address, "c")
        d = _hello(ctx, receiver.address, "d")  # a third under way: the oldest, b's, goes
        assert [_prove(*d), _prove(*c), _prove(*b)] == ["welcome", "welcome", "refused"]
    finally:
        ctx.destroy(linger=0)
    # A peer that connects again replaces its old connection: one is remembered.
    loop = receiver._thread._target.__self__
    assert list(loop.welcomed.values()).count(dialer.engine_id) == 1
    assert not loop.accepting


def test_connections_sending_garbage_are_remembered_and_logged_within_bounds(
        engines, monkeypatch, caplog):
    """Each new connection has a new routing id: one that sends one bad header and goes must
    cost neither memory that grows with connections nor a warning each."""
    monkeypatch.setattr(zmq_state, "MAX_MALFORMED_LOGGED", 4)
    engine = engines()
    ctx = zmq.Context()
    caplog.set_level(logging.WARNING, logger="kvtier.transport.zmq_state")
    try:
        for i in range(10):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(engine.address)
            dealer.send(b"\xc1garbage")
            wait_until(lambda n=i + 1: engine.stats()["malformed"] == n)
            dealer.close()
    finally:
        ctx.destroy(linger=0)
    assert len(engine._thread._target.__self__.malformed_logged) == 4
    assert [r.getMessage() for r in caplog.records] == [
        "transport: dropped a malformed message from a peer: header is not msgpack: "]


def test_replies_to_a_peer_that_never_reads_are_dropped_and_counted_not_queued(engines):
    """Each hello from another namespace is answered with a refusal; a peer that sends them
    without reading its socket must not make the engine queue refusals without bound."""
    engine = engines()
    num_hellos = 100_000  # more than the kernel's socket buffers and MAX_QUEUED_REPLIES hold
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.setsockopt(zmq.RCVTIMEO, 5000)
        dealer.setsockopt(zmq.SNDHWM, 0)
        dealer.setsockopt(zmq.RCVHWM, 1)
        dealer.setsockopt(zmq.RCVBUF, 4096)
        dealer.connect(engine.address)
        hello = protocol.encode("hello", v=protocol.PROTOCOL_VERSION, engine="flood",
                                ns=OTHER_NAMESPACE.hex(), nonce=bytes(32), auth=False)
        for _ in range(num_hellos):
            dealer.send(hello)
        wait_until(lambda: engine.stats()["refused_namespace"] == num_hellos, timeout_s=60)
        num_dropped = engine.stats()["replies_dropped"]
        assert num_dropped > 0
        # Every refusal was either queued or counted: the queued ones, then nothing else.
        for _ in range(num_hellos - num_dropped):
            assert protocol.decode(dealer.recv())["code"] == protocol.REFUSED_NAMESPACE
        dealer.send(protocol.encode("offer", id="t", sizes=[1], ttl_ms=1000))
        assert protocol.decode(dealer.recv())["code"] == protocol.REFUSED_PROTOCOL
    finally:
        ctx.destroy(linger=0)


def test_malformed_warnings_held_back_are_counted_in_the_next(monkeypatch, caplog):
    monkeypatch.setattr(zmq_state, "MAX_MALFORMED_LOGGED", 3)
    now = [100.0]
    counts = {"malformed": 0}
    log = MalformedLog(counts, clock=lambda: now[0])
    bad = MalformedMessageError("bad")
    with caplog.at_level(logging.WARNING, logger="kvtier.transport.zmq_state"):
        for source in (b"a", b"b", b"c", b"d", b"a"):  # a was forgotten: d pushed it out
            log.record(source, bad)
        now[0] += zmq_state.MALFORMED_WARNING_INTERVAL_S
        log.record(b"e", bad)
        log.record(b"e", bad)  # logged already
    assert [r.getMessage() for r in caplog.records] == [
        "transport: dropped a malformed message from a peer: bad",
        "transport: dropped a malformed message from a peer: bad (4 more connections sent "
        "malformed messages since the last warning)"]
    assert counts["malformed"] == 7 and len(log) == 3
