"""What only the zmq backend does: zero-copy frames handed back to the caller only after zmq
let go of them, even when the peer stops reading; the wire protocol (eager offers, data
messages in order, done only once every byte is in), checked against a raw zmq peer."""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq
import zmq.utils.garbage as zmq_garbage

from kvtier.transport import Region, TransferId, TransportConfig, protocol, zmq_transfer
from kvtier.transport.zmq_engine import ZmqTransferEngine
from kvtier.transport.zmq_transfer import DATA_MESSAGE_BYTES, EAGER_BYTES
from tests.transport.transport_helpers import (
    NAMESPACE,
    greet,
    wait_results,
    wait_until,
    welcome,
)


def test_send_stuck_in_a_peer_that_stopped_reading_is_released_at_its_deadline():
    """A peer that accepts and then never reads: zero-copy frames stay queued in our zmq. At the
    deadline the engine must make zmq drop them before it hands the buffer back."""
    ctx = zmq.Context()
    stuck = ctx.socket(zmq.ROUTER)
    stuck.setsockopt(zmq.LINGER, 0)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 65536)
    port = stuck.bind_to_random_port("tcp://127.0.0.1")
    sender = ZmqTransferEngine(TransportConfig(NAMESPACE))
    size = 32 << 20
    sender.register_buffer("src", memoryview(bytearray(2 * size)))
    ns = sender.config.namespace.hex()

    def answer(kind: str, reply: str, **fields) -> bytes:
        source, header, *_payload = stuck.recv_multipart()
        assert protocol.decode(header)["t"] == kind
        stuck.send_multipart([source, protocol.encode(reply, **fields)])
        return source

    try:
        connected: list = []
        connecting = threading.Thread(target=lambda: connected.append(
            sender.connect(f"tcp://127.0.0.1:{port}", timeout_s=5)))
        connecting.start()
        answer("hello", "hello_ack", engine="stuck", ns=ns, nonce=os.urandom(32),
               auth=False, proof=None)
        answer("proof", "welcome")
        connecting.join()
        for i in range(2):
            sender.send(connected[0], TransferId(f"big{i}"), [Region("src", i * size, size)],
                        timeout_s=1.0)
        # Accept both, then never read again: the first data message fills our receive queue
        # (one message), so the second stays in the sender's zmq queue.
        for i in range(2):
            answer("offer", "accept", id=f"big{i}", offset=0)
        start = time.monotonic()
        results = wait_results(sender, 2, timeout_s=5)
        assert all(r.error for r in results) and time.monotonic() - start < 3.0
        assert not zmq_garbage.gc.refs  # zmq holds no frame of the buffer any more
        sender.unregister_buffer("src")
    finally:
        sender.shutdown(timeout_s=2)
        stuck.close()
        ctx.term()


def test_a_send_failed_by_its_receiver_with_frames_still_queued_is_released_by_its_deadline(
        raw_peer):
    stuck = raw_peer(zmq.ROUTER)
    stuck.setsockopt(zmq.RCVHWM, 1)
    stuck.setsockopt(zmq.RCVBUF, 65536)
    sender = ZmqTransferEngine(TransportConfig(NAMESPACE))
    try:
        sender.register_buffer("src", memoryview(bytearray(32 << 20)))
        [peer] = welcome(stuck, sender)
        sender.send(peer, TransferId("big"), [Region("src", 0, 32 << 20)], timeout_s=1.0)
        source, *_ = stuck.recv_multipart()
        stuck.send_multipart([source, protocol.encode("accept", id="big", offset=0)])
        # Then fail it at once and never read again: most data messages stay queued.
        stuck.send_multipart([source, protocol.encode("fail", id="big", error="no")])
        start = time.monotonic()
        [result] = wait_results(sender, 1, timeout_s=5)
        assert result.error == "no" and time.monotonic() - start < 3.0
        assert not zmq_garbage.gc.refs
        sender.unregister_buffer("src")
    finally:
        sender.shutdown(timeout_s=2)


# ---- the protocol, with a raw zmq socket standing in for the peer ---------------------------

def _offer(dealer: zmq.Socket, tid: str, total: int, payload: list[bytes],
           ttl_ms: int = 10_000) -> None:
    dealer.send_multipart([protocol.encode("offer", id=tid, sizes=[total], ttl_ms=ttl_ms),
                           *payload])


def _data(dealer: zmq.Socket, tid: str, offset: int, payload: list[bytes]) -> None:
    dealer.send_multipart([protocol.encode("data", id=tid, offset=offset), *payload])


def _reply(dealer: zmq.Socket) -> dict:
    return protocol.decode(dealer.recv())


def _settled(dealer: zmq.Socket, receiver) -> None:
    """Wait until the receiver handled everything `dealer` sent so far: a data message for no
    transfer, sent last, is counted late once handled."""
    late = receiver.stats()["late_messages"]
    _data(dealer, "no-such-transfer", 0, [b"x"])
    wait_until(lambda: receiver.stats()["late_messages"] == late + 1)


@pytest.fixture
def make_zmq_engine():
    engines = []

    def make(**options) -> ZmqTransferEngine:
        engines.append(ZmqTransferEngine(TransportConfig(NAMESPACE, **options)))
        return engines[-1]

    yield make
    for engine in engines:
        engine.shutdown(timeout_s=2.0)


@pytest.fixture
def receiver_and_dealer(make_zmq_engine, raw_peer):
    receiver = make_zmq_engine()
    dealer = raw_peer(zmq.DEALER)
    greet(dealer, receiver)
    return receiver, dealer


@pytest.mark.parametrize("posted_first", [True, False])
def test_a_transfer_that_comes_whole_with_its_offer_needs_no_accept(receiver_and_dealer,
                                                                   posted_first):
    receiver, dealer = receiver_and_dealer
    data = os.urandom(3000)
    dst = bytearray(3000)
    receiver.register_buffer("dst", memoryview(dst))
    regions = [Region("dst", 0, 1001), Region("dst", 1001, 1999)]
    if posted_first:
        receiver.recv(TransferId("small"), regions, timeout_s=10)
    _offer(dealer, "small", 3000, [data[:7], data[7:]])  # cut unlike the receiver's regions
    if not posted_first:  # the bytes wait with the offer until the recv is posted
        _settled(dealer, receiver)
        assert receiver.get_finished() == []
        receiver.recv(TransferId("small"), regions, timeout_s=10)
    assert _reply(dealer) == {"t": "done", "id": "small"}
    [result] = wait_results(receiver, 1, timeout_s=5)
    assert result.ok and dst == data
    assert receiver.stats()["bytes_received"] == 3000


def test_a_transfer_in_several_data_messages_is_done_only_after_the_last(receiver_and_dealer):
    receiver, dealer = receiver_and_dealer
    data = os.urandom(10_007)
    dst = bytearray(10_007)
    receiver.register_buffer("dst", memoryview(dst))
    receiver.recv(TransferId("big"), [Region("dst", 0, 3), Region("dst", 3, 6000),
                                      Region("dst", 6003, 4004)], timeout_s=10)
    _offer(dealer, "big", 10_007, [data[:1000]])
    assert _reply(dealer) == {"t": "accept", "id": "big", "offset": 1000}
    _data(dealer, "big", 1000, [data[1000:2500], data[2500:6001]])
    assert not dealer.poll(200)  # 4006 bytes still due: no done
    assert receiver.get_finished() == []
    _data(dealer, "big", 6001, [data[6001:]])
    assert _reply(dealer) == {"t": "done", "id": "big"}
    [result] = wait_results(receiver, 1, timeout_s=5)
    assert result.ok and dst == data


def test_a_sender_that_dies_midway_fails_the_receive_by_its_deadline(receiver_and_dealer):
    receiver, dealer = receiver_and_dealer
    data = os.urandom(9000)
    dst = bytearray(9000)
    receiver.register_buffer("dst", memoryview(dst))
    start = time.monotonic()
    receiver.recv(TransferId("cut"), [Region("dst", 0, 9000)], timeout_s=0.5)
    _offer(dealer, "cut", 9000, [data[:2000]])
    assert _reply(dealer)["offset"] == 2000
    _data(dealer, "cut", 2000, [data[2000:5000]])
    _settled(dealer, receiver)
    dealer.close()  # the sender dies with 4000 bytes not sent
    [result] = wait_results(receiver, 1, timeout_s=3)
    assert not result.ok and "deadline" in result.error
    assert 0.5 <= time.monotonic() - start < 2.5
    assert receiver.stats()["received"] == 0 and receiver.stats()["recv_failed"] == 1
    receiver.unregister_buffer("dst")  # the engine let go of the region


@pytest.mark.parametrize(("offset", "size", "error"), [
    (3000, 1000, "expected byte 2000"),        # a gap
    (1000, 1000, "expected byte 2000"),        # a repeat
    (2000, 7001, "more bytes than it offered"),
])
def test_data_out_of_order_or_beyond_the_offer_fails_both_sides(receiver_and_dealer, offset,
                                                                 size, error):
    receiver, dealer = receiver_and_dealer
    dst = bytearray(9000)
    receiver.register_buffer("dst", memoryview(dst))
    receiver.recv(TransferId("bad"), [Region("dst", 0, 9000)], timeout_s=10)
    _offer(dealer, "bad", 9000, [bytes(2000)])
    assert _reply(dealer)["t"] == "accept"
    _data(dealer, "bad", offset, [bytes(size)])
    reply = _reply(dealer)
    assert reply["t"] == "fail" and error in reply["error"]
    [result] = wait_results(receiver, 1, timeout_s=5)
    assert result.error == reply["error"]
    _data(dealer, "bad", 2000, [bytes(7000)])  # the rest, too late: dropped
    wait_until(lambda: receiver.stats()["late_messages"] == 1)


def test_an_offer_bringing_more_than_it_offers_is_refused(receiver_and_dealer):
    receiver, dealer = receiver_and_dealer
    receiver.register_buffer("dst", memoryview(bytearray(100)))
    receiver.recv(TransferId("over"), [Region("dst", 0, 100)], timeout_s=10)
    _offer(dealer, "over", 100, [bytes(101)])
    reply = _reply(dealer)
    assert reply["t"] == "fail" and "more bytes than it offered" in reply["error"]
    assert not wait_results(receiver, 1, timeout_s=5)[0].ok


def test_bytes_beyond_the_receivers_room_are_asked_for_again(receiver_and_dealer,
                                                             monkeypatch):
    receiver, dealer = receiver_and_dealer
    monkeypatch.setattr(zmq_transfer, "MAX_KEPT_EAGER_BYTES", 1500)
    first, second = os.urandom(1000), os.urandom(1000)
    dst = bytearray(2000)
    receiver.register_buffer("dst", memoryview(dst))
    _offer(dealer, "kept", 1000, [first])
    _offer(dealer, "dropped", 1000, [second])  # 2000 bytes would not fit in 1500
    _settled(dealer, receiver)
    receiver.recv(TransferId("kept"), [Region("dst", 0, 1000)], timeout_s=10)
    assert _reply(dealer) == {"t": "done", "id": "kept"}
    receiver.recv(TransferId("dropped"), [Region("dst", 1000, 1000)], timeout_s=10)
    assert _reply(dealer) == {"t": "accept", "id": "dropped", "offset": 0}
    _data(dealer, "dropped", 0, [second])
    assert _reply(dealer) == {"t": "done", "id": "dropped"}
    assert all(r.ok for r in wait_results(receiver, 2, timeout_s=5))
    assert dst == first + second


def test_an_offer_is_forgotten_once_its_sender_gave_up(receiver_and_dealer):
    receiver, dealer = receiver_and_dealer
    dst = bytearray(1000)
    receiver.register_buffer("dst", memoryview(dst))
    _offer(dealer, "stale", 1000, [os.urandom(1000)], ttl_ms=100)
    _settled(dealer, receiver)
    time.sleep(0.4)  # past the offer's time to live, and a deadline check or more
    receiver.recv(TransferId("stale"), [Region("dst", 0, 1000)], timeout_s=0.5)
    [result] = wait_results(receiver, 1, timeout_s=3)
    assert "deadline" in result.error and dst == bytes(1000)
    assert not dealer.poll(0)  # neither accepted nor done


def test_a_sender_that_dialed_again_may_offer_its_transfers_again(receiver_and_dealer,
                                                                    raw_peer):
    """A sender whose connection closed (a send's deadline) fails every transfer on it and
    offers some again on a new one: the receiver drops what it held from the old connection
    (a waiting offer, a matched receive) and takes the new offers."""
    receiver, old = receiver_and_dealer
    waiting, matched = os.urandom(1000), os.urandom(3000)
    dst = bytearray(4000)
    receiver.register_buffer("dst", memoryview(dst))
    _offer(old, "waiting", 1000, [bytes(1000)])
    receiver.recv(TransferId("matched"), [Region("dst", 1000, 3000)], timeout_s=10)
    _offer(old, "matched", 3000, [bytes(1000)])
    assert _reply(old) == {"t": "accept", "id": "matched", "offset": 1000}
    new = raw_peer(zmq.DEALER)
    greet(new, receiver)  # the same engine id, "raw", on a new connection
    _offer(new, "matched", 3000, [matched[:1000]])
    assert _reply(new) == {"t": "accept", "id": "matched", "offset": 1000}
    _data(new, "matched", 1000, [matched[1000:]])
    assert _reply(new) == {"t": "done", "id": "matched"}
    _offer(new, "waiting", 1000, [waiting])
    _settled(new, receiver)
    receiver.recv(TransferId("waiting"), [Region("dst", 0, 1000)], timeout_s=10)
    assert _reply(new) == {"t": "done", "id": "waiting"}
    results = wait_results(receiver, 2, timeout_s=5)
    assert [(r.transfer_id, r.error) for r in results] == [("matched", None), ("waiting", None)]
    assert dst == waiting + matched
    assert not old.poll(200)  # nothing more went to the old connection


def test_an_offer_nobody_claims_is_failed_back_and_a_late_recv_fails_at_once(make_zmq_engine,
                                                                              raw_peer):
    receiver = make_zmq_engine(unclaimed_offer_timeout_s=0.3)
    dealer = raw_peer(zmq.DEALER)
    greet(dealer, receiver)
    data = os.urandom(1000)
    dst = bytearray(1000)
    receiver.register_buffer("dst", memoryview(dst))
    start = time.monotonic()
    _offer(dealer, "t", 1000, [bytes(1000)])  # its sender would wait 10 s
    assert _reply(dealer) == {"t": "fail", "id": "t",
                              "error": "the receiver posted no recv for it within 0.3 s"}
    assert 0.3 <= time.monotonic() - start < 1.5
    receiver.recv(TransferId("t"), [Region("dst", 0, 1000)], timeout_s=10)
    [result] = wait_results(receiver, 1, timeout_s=1)
    assert result.error == "its offer came and waited 0.3 s for this recv; its sender was " \
                           "told to give up"
    assert not dealer.poll(0)
    # An offer sent again may be claimed as usual.
    _offer(dealer, "t", 1000, [data])
    _settled(dealer, receiver)
    receiver.recv(TransferId("t"), [Region("dst", 0, 1000)], timeout_s=10)
    assert _reply(dealer) == {"t": "done", "id": "t"}
    assert wait_results(receiver, 1, timeout_s=5)[0].ok and dst == data
    with pytest.raises(ValueError, match="unclaimed_offer_timeout_s must be > 0"):
        TransportConfig(NAMESPACE, unclaimed_offer_timeout_s=0)


def test_offers_waiting_at_shutdown_are_failed_back(make_zmq_engine, raw_peer):
    receiver = make_zmq_engine()
    dealer = raw_peer(zmq.DEALER)
    greet(dealer, receiver)
    _offer(dealer, "t", 1000, [bytes(1000)])  # its sender would wait 10 s
    _settled(dealer, receiver)
    receiver.shutdown(timeout_s=2.0)
    assert _reply(dealer) == {"t": "fail", "id": "t", "error": "the receiver shut down"}


# ---- the sending side, with a raw zmq socket as the receiver ---------------------------------

def test_the_sender_sends_its_first_bytes_with_the_offer_and_the_rest_as_asked(
        make_zmq_engine, raw_peer):
    sender = make_zmq_engine()
    total = EAGER_BYTES + DATA_MESSAGE_BYTES + 777
    data = os.urandom(total)
    sender.register_buffer("src", memoryview(bytearray(data)))
    router = raw_peer(zmq.ROUTER)
    [peer] = welcome(router, sender)
    cuts = [0, 5, EAGER_BYTES + 3, total]  # regions across the message boundaries
    sender.send(peer, TransferId("t"), [Region("src", a, b - a) for a, b in zip(cuts, cuts[1:])],
                timeout_s=10)
    source, header, *payload = router.recv_multipart()
    offer = protocol.decode(header)
    assert offer["sizes"] == [5, EAGER_BYTES - 2, total - EAGER_BYTES - 3]
    assert 0 < offer["ttl_ms"] <= 10_000 and b"".join(payload) == data[:EAGER_BYTES]
    # As a receiver that had no room to keep them: everything again, from byte 0.
    router.send_multipart([source, protocol.encode("accept", id="t", offset=0)])
    received = b""
    while len(received) < total:
        _, header, *payload = router.recv_multipart()
        message = protocol.decode(header)
        assert message == {"t": "data", "id": "t", "offset": len(received)}
        assert len(b"".join(payload)) <= DATA_MESSAGE_BYTES
        received += b"".join(payload)
    assert received == data
    assert sender.get_finished() == []  # not before the receiver's done
    router.send_multipart([source, protocol.encode("done", id="t")])
    [result] = wait_results(sender, 1, timeout_s=5)
    assert result.ok and sender.stats()["bytes_sent"] == total


def test_an_accept_for_bytes_never_sent_fails_the_send_on_both_sides(make_zmq_engine,
                                                                     raw_peer):
    sender = make_zmq_engine()
    sender.register_buffer("src", memoryview(bytearray(EAGER_BYTES + 10)))
    router = raw_peer(zmq.ROUTER)
    [peer] = welcome(router, sender)
    sender.send(peer, TransferId("t"), [Region("src", 0, EAGER_BYTES + 10)], timeout_s=10)
    source, *_ = router.recv_multipart()
    router.send_multipart([source, protocol.encode("accept", id="t", offset=EAGER_BYTES + 1)])
    [result] = wait_results(sender, 1, timeout_s=5)
    _, header = router.recv_multipart()
    assert protocol.decode(header) == {"t": "fail", "id": "t", "error": result.error}
    assert "beyond" in result.error
