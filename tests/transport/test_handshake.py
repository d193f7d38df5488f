"""The handshake before any KV moves: equal namespaces and (when configured) a proven shared
secret, or a typed refusal that both sides count; nothing a peer sends is unpickled."""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

import pytest
import zmq

from kvtier.transport import (
    AuthenticationError,
    HandshakeError,
    NamespaceMismatchError,
    Region,
    TransferId,
    protocol,
)
from tests.transport.transport_helpers import OTHER_NAMESPACE, SECRET, wait_results, wait_until


def _transfer_works(receiver, sender, peer) -> None:
    data = os.urandom(70_000)
    src, dst = bytearray(data), bytearray(len(data))
    sender.register_buffer("hs-src", memoryview(src))
    receiver.register_buffer("hs-dst", memoryview(dst))
    receiver.recv(TransferId("hs"), [Region("hs-dst", 0, len(dst))], timeout_s=10)
    sender.send(peer, TransferId("hs"), [Region("hs-src", 0, len(src))], timeout_s=10)
    assert wait_results(receiver, 1, timeout_s=10)[0].ok
    assert dst == data


def test_same_namespace_is_accepted(make_engine):
    receiver, sender = make_engine(), make_engine()
    peer = sender.connect(receiver.address, timeout_s=5)
    assert peer == receiver.engine_id
    _transfer_works(receiver, sender, peer)


def test_other_namespace_is_refused_counted_and_logged_once(make_engine, caplog):
    receiver, sender = make_engine(), make_engine(namespace=OTHER_NAMESPACE)
    with caplog.at_level(logging.WARNING, logger="kvtier.transport"):
        for _ in range(3):
            with pytest.raises(NamespaceMismatchError, match="not interchangeable"):
                sender.connect(receiver.address, timeout_s=5)
    assert receiver.stats()["refused_namespace"] == 3
    assert sender.stats()["refused_namespace"] == 3
    refused_by_receiver = [r for r in caplog.records if sender.engine_id in r.getMessage()]
    assert len(refused_by_receiver) == 1


def test_same_secret_is_accepted(make_engine):
    receiver, sender = make_engine(secret=SECRET), make_engine(secret=SECRET)
    peer = sender.connect(receiver.address, timeout_s=5)
    _transfer_works(receiver, sender, peer)


@pytest.mark.parametrize(("receiver_secret", "sender_secret"), [
    (SECRET, SECRET[::-1]), (SECRET, None), (None, SECRET)])
def test_wrong_or_missing_secret_is_refused(make_engine, receiver_secret, sender_secret):
    receiver = make_engine(secret=receiver_secret)
    sender = make_engine(secret=sender_secret)
    with pytest.raises(AuthenticationError):
        sender.connect(receiver.address, timeout_s=5)
    assert sender.stats()["refused_secret"] == 1
    # The receiver hears of a refusal by the sender a moment later.
    wait_until(lambda: receiver.stats()["refused_secret"] == 1)


@pytest.fixture
def raw_dealer(make_engine):
    receiver = make_engine()
    ctx = zmq.Context()
    socket = ctx.socket(zmq.DEALER)
    socket.setsockopt(zmq.LINGER, 0)
    socket.setsockopt(zmq.RCVTIMEO, 3000)
    socket.connect(receiver.address)
    yield receiver, socket
    socket.close()
    ctx.term()


class _Exploit:
    """Unpickling this creates a file: proof that a pickle was executed."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return (Path.touch, (self.path,))


def test_a_pickle_is_rejected_as_malformed_never_executed(raw_dealer, tmp_path, make_engine):
    receiver, socket = raw_dealer
    marker = tmp_path / "executed"
    evil = pickle.dumps(_Exploit(marker))
    with pytest.raises(protocol.MalformedMessageError):
        protocol.decode(evil)
    socket.send(evil)  # as a header, before any handshake
    hello = protocol.encode("hello", v=protocol.PROTOCOL_VERSION, engine="raw",
                            ns=receiver.config.namespace.hex(), nonce=os.urandom(32), auth=False)
    socket.send(hello)
    assert protocol.decode(socket.recv())["t"] == "hello_ack"
    socket.send_multipart([evil, evil])  # and mid-handshake, with a payload frame
    wait_until(lambda: receiver.stats()["malformed"] == 2)
    assert not marker.exists()
    # The receiver keeps serving honest peers.
    sender = make_engine()
    _transfer_works(receiver, sender, sender.connect(receiver.address, timeout_s=5))


def test_transfer_messages_before_the_handshake_are_refused(raw_dealer):
    receiver, socket = raw_dealer
    # An offer with its bytes along, as a small transfer's is.
    socket.send_multipart([protocol.encode("offer", id="sneaky", sizes=[10], ttl_ms=5000),
                           b"0123456789"])
    reply = protocol.decode(socket.recv())
    assert reply["t"] == "refused" and reply["code"] == protocol.REFUSED_PROTOCOL
    assert receiver.stats()["refused_protocol"] == 1


def test_silent_acceptor_times_out(make_engine):
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)
    silent.setsockopt(zmq.LINGER, 0)
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(TimeoutError):
            make_engine().connect(f"tcp://127.0.0.1:{port}", timeout_s=0.5)
    finally:
        silent.close()
        ctx.term()


def test_handshake_errors_share_a_base():
    assert issubclass(NamespaceMismatchError, HandshakeError)
    assert issubclass(AuthenticationError, HandshakeError)

