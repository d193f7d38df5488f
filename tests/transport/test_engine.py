"""The contract every transfer engine backend must keep (run once per backend in BACKENDS):
bytes arrive identical, transfers complete independently, every transfer ends by its deadline
and a dead peer costs the survivor nothing but that peer's transfers."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvtier.transport import Direction, Region, TransferId, TransportError
from tests.transport.peer_process import payload
from tests.transport.transport_helpers import NAMESPACE, wait_results

REPO = Path(__file__).resolve().parents[2]
# Frame sizes around zmq's zero-copy threshold (64 KiB) and a few large ones.
SIZES = [1, 17, 4096, 65535, 65536, 65537, 1 << 20, 3 * (1 << 20) + 5]


def _pair(make_engine):
    receiver, sender = make_engine(), make_engine()
    peer = sender.connect(receiver.address, timeout_s=5)
    assert peer == receiver.engine_id
    return receiver, sender, peer


def _split(offset: int, length: int, parts: int, buffer_id: str) -> list[Region]:
    """`length` bytes at `offset` cut into up to `parts` regions of unequal sizes."""
    cuts = sorted({0, length, *random.Random(length).sample(range(1, max(length, 2)),
                                                             min(parts - 1, length - 1))})
    return [Region(buffer_id, offset + a, b - a) for a, b in zip(cuts, cuts[1:])]


def test_many_chunks_of_different_sizes_arrive_identical(make_engine):
    receiver, sender, peer = _pair(make_engine)
    sizes = SIZES * 4
    src = bytearray(os.urandom(sum(sizes)))
    dst = bytearray(len(src))
    sender.register_buffer("src", memoryview(src))
    receiver.register_buffer("dst", memoryview(dst))
    offset = 0
    for i, size in enumerate(sizes):
        # Different scatter-gather on each side: only the byte stream has to match.
        receiver.recv(TransferId(f"c{i}"), _split(offset, size, 3, "dst"), timeout_s=20)
        sender.send(peer, TransferId(f"c{i}"), _split(offset, size, 2, "src"), timeout_s=20)
        offset += size
    received = wait_results(receiver, len(sizes), timeout_s=25)
    sent = wait_results(sender, len(sizes), timeout_s=5)
    assert all(r.ok for r in received + sent), [r for r in received + sent if not r.ok]
    assert {r.transfer_id for r in received} == {f"c{i}" for i in range(len(sizes))}
    assert dst == src
    assert receiver.stats()["bytes_received"] == sender.stats()["bytes_sent"] == len(src)


@pytest.mark.parametrize("posted_first", [True, False])
def test_a_transfer_of_many_mib_arrives_identical_across_unequal_regions(make_engine,
                                                                        posted_first):
    # Over 3 of the zmq backend's data messages (4 MiB) and an odd size, cut differently on
    # each side, both when the recv waits for the offer and when the offer waits for the recv.
    receiver, sender, peer = _pair(make_engine)
    size = 13 * (1 << 20) + 12_345
    src = bytearray(os.urandom(size + 100))
    dst = bytearray(size + 100)
    sender.register_buffer("src", memoryview(src))
    receiver.register_buffer("dst", memoryview(dst))
    sender_regions, receiver_regions = _split(100, size, 5, "src"), _split(0, size, 7, "dst")
    if posted_first:
        receiver.recv(TransferId("big"), receiver_regions, timeout_s=30)
    sender.send(peer, TransferId("big"), sender_regions, timeout_s=30)
    if not posted_first:
        time.sleep(0.2)
        receiver.recv(TransferId("big"), receiver_regions, timeout_s=30)
    [received] = wait_results(receiver, 1, timeout_s=30)
    [sent] = wait_results(sender, 1, timeout_s=10)
    assert received.ok and sent.ok
    assert dst[:size] == src[100:] and dst[size:] == bytes(100)
    assert receiver.stats()["bytes_received"] == sender.stats()["bytes_sent"] == size


def test_transfers_complete_out_of_posting_order(make_engine):
    receiver, sender, peer = _pair(make_engine)
    n, size = 6, 100_000
    src = bytearray(os.urandom(n * size))
    dst = bytearray(n * size)
    sender.register_buffer("src", memoryview(src))
    receiver.register_buffer("dst", memoryview(dst))
    for i in range(n):
        receiver.recv(TransferId(f"t{i}"), [Region("dst", i * size, size)], timeout_s=20)
    order = []
    for i in reversed(range(n)):  # one at a time, last posted first
        sender.send(peer, TransferId(f"t{i}"), [Region("src", i * size, size)], timeout_s=20)
        [done] = wait_results(receiver, 1, timeout_s=20)
        order.append(done.transfer_id)
    assert order == [f"t{i}" for i in reversed(range(n))]
    assert dst == src
    assert all(r.ok for r in wait_results(sender, n, timeout_s=5))


def test_get_finished_waits_for_a_result_and_returns_as_soon_as_it_lands(make_engine):
    receiver, sender, peer = _pair(make_engine)
    src, dst = bytearray(os.urandom(1 << 20)), bytearray(1 << 20)
    sender.register_buffer("src", memoryview(src))
    receiver.register_buffer("dst", memoryview(dst))
    receiver.recv(TransferId("late"), [Region("dst", 0, 1 << 20)], timeout_s=20)
    send = threading.Timer(0.3, sender.send, (peer, TransferId("late"),
                                              [Region("src", 0, 1 << 20)], 20))
    start = time.monotonic()
    send.start()
    received = receiver.get_finished(timeout_s=10)
    elapsed = time.monotonic() - start
    send.join()
    assert [(r.transfer_id, r.direction, r.error) for r in received] == \
        [("late", Direction.RECV, None)]
    assert 0.3 <= elapsed < 2.0  # woken by the result, not by its 10 s deadline
    assert dst == src
    [sent] = sender.get_finished(timeout_s=10)
    assert (sent.transfer_id, sent.direction, sent.error) == ("late", Direction.SEND, None)


def test_get_finished_returns_empty_at_its_deadline_and_never_blocks_by_default(make_engine):
    engine = make_engine()
    engine.register_buffer("dst", memoryview(bytearray(64)))
    engine.recv(TransferId("never"), [Region("dst", 0, 64)], timeout_s=5)
    start = time.monotonic()
    assert engine.get_finished() == []
    assert time.monotonic() - start < 0.05
    assert engine.get_finished(timeout_s=0.2) == []
    assert 0.2 <= time.monotonic() - start < 1.5


def test_interrupt_get_finished_ends_the_wait_under_way_and_the_next_one(make_engine):
    engine = make_engine()
    engine.register_buffer("dst", memoryview(bytearray(64)))
    engine.recv(TransferId("never"), [Region("dst", 0, 64)], timeout_s=30)
    timer = threading.Timer(0.1, engine.interrupt_get_finished)
    start = time.monotonic()
    timer.start()
    assert engine.get_finished(timeout_s=20) == []
    timer.join()
    assert time.monotonic() - start < 10  # the interrupt, not the timeout, ended it
    engine.interrupt_get_finished()  # before the call: the next wait returns at once
    start = time.monotonic()
    assert engine.get_finished(timeout_s=20) == []
    assert time.monotonic() - start < 10
    start = time.monotonic()
    assert engine.get_finished(timeout_s=0.2) == []  # consumed: this one waits
    assert time.monotonic() - start >= 0.2


def test_each_result_goes_to_one_of_several_waiters(make_engine):
    engine = make_engine()
    engine.register_buffer("dst", memoryview(bytearray(64)))
    taken: list[list] = []

    def wait() -> None:
        taken.append(engine.get_finished(timeout_s=3))

    waiters = [threading.Thread(target=wait) for _ in range(3)]
    for waiter in waiters:
        waiter.start()
    engine.recv(TransferId("one"), [Region("dst", 0, 64)], timeout_s=0.2)
    for waiter in waiters:
        waiter.join(5)
    results = [r for batch in taken for r in batch]
    assert [(r.transfer_id, r.direction) for r in results] == [("one", Direction.RECV)]
    assert "deadline" in results[0].error
    assert engine.get_finished() == []


def test_recv_without_sender_fails_by_its_deadline(make_engine):
    receiver = make_engine()
    dst = bytearray(b"\x07" * 64)
    receiver.register_buffer("dst", memoryview(dst))
    start = time.monotonic()
    receiver.recv(TransferId("lonely"), [Region("dst", 0, 64)], timeout_s=0.5)
    [result] = wait_results(receiver, 1, timeout_s=3)
    elapsed = time.monotonic() - start
    assert result.transfer_id == "lonely" and result.direction is Direction.RECV
    assert result.error is not None and "deadline" in result.error
    assert 0.5 <= elapsed < 2.5
    assert dst == b"\x07" * 64
    receiver.unregister_buffer("dst")  # the engine let go of it


def test_send_without_recv_fails_by_its_deadline_and_releases_the_buffer(make_engine):
    receiver, sender, peer = _pair(make_engine)
    sender.register_buffer("src", memoryview(bytearray(1 << 20)))
    sender.send(peer, TransferId("unwanted"), [Region("src", 0, 1 << 20)], timeout_s=0.5)
    with pytest.raises(TransportError, match="pending"):
        sender.unregister_buffer("src")
    [result] = wait_results(sender, 1, timeout_s=3)
    assert result.direction is Direction.SEND and "deadline" in result.error
    sender.unregister_buffer("src")
    # The receiver forgot the offer too: a recv posted now waits for a new one.
    receiver.register_buffer("dst", memoryview(bytearray(1 << 20)))
    receiver.recv(TransferId("unwanted"), [Region("dst", 0, 1 << 20)], timeout_s=0.3)
    [late] = wait_results(receiver, 1, timeout_s=3)
    assert late.error is not None


def test_a_send_failed_by_its_closed_connection_may_be_sent_again_on_a_new_one(make_engine):
    """Dialing a peer again closes the old connection and fails the sends on it (as a send's
    deadline does); the receiver forgets what came over it and takes the offer sent again."""
    receiver, sender, peer = _pair(make_engine)
    src = bytearray(os.urandom(1000))
    dst = bytearray(1000)
    sender.register_buffer("src", memoryview(src))
    receiver.register_buffer("dst", memoryview(dst))
    sender.send(peer, TransferId("t"), [Region("src", 0, 1000)], timeout_s=10)
    time.sleep(0.2)  # the offer waits at the receiver for its recv
    assert sender.connect(receiver.address, timeout_s=5) == peer
    [first] = wait_results(sender, 1, timeout_s=5)
    assert first.error == "connection to the peer closed (deadline or refusal)"
    sender.send(peer, TransferId("t"), [Region("src", 0, 1000)], timeout_s=10)
    receiver.recv(TransferId("t"), [Region("dst", 0, 1000)], timeout_s=5)
    [received] = wait_results(receiver, 1, timeout_s=5)
    [sent] = wait_results(sender, 1, timeout_s=5)
    assert (received.error, sent.error) == (None, None) and dst == src


def test_size_mismatch_fails_both_sides(make_engine):
    receiver, sender, peer = _pair(make_engine)
    sender.register_buffer("src", memoryview(bytearray(200)))
    receiver.register_buffer("dst", memoryview(bytearray(100)))
    receiver.recv(TransferId("x"), [Region("dst", 0, 100)], timeout_s=5)
    sender.send(peer, TransferId("x"), [Region("src", 0, 200)], timeout_s=5)
    [got] = wait_results(receiver, 1, timeout_s=5)
    [sent] = wait_results(sender, 1, timeout_s=5)
    assert "200 bytes" in got.error and "200 bytes" in sent.error


def test_bad_calls_raise_at_once(make_engine):
    engine = make_engine()
    engine.register_buffer("b", memoryview(bytearray(10)))
    with pytest.raises(TransportError, match="outside buffer"):
        engine.recv(TransferId("a"), [Region("b", 5, 6)], timeout_s=1)
    with pytest.raises(TransportError, match="not registered"):
        engine.recv(TransferId("a"), [Region("nope", 0, 1)], timeout_s=1)
    with pytest.raises(TransportError, match="timeout_s"):
        engine.recv(TransferId("a"), [Region("b", 0, 1)], timeout_s=0)
    with pytest.raises(TransportError, match="transfer id"):
        engine.recv(TransferId("x" * 2000), [Region("b", 0, 1)], timeout_s=1)
    with pytest.raises(TransportError, match="regions"):
        engine.recv(TransferId("a"), [Region("b", 0, 1)] * 5000, timeout_s=1)
    engine.recv(TransferId("a"), [Region("b", 0, 1)], timeout_s=1)
    with pytest.raises(TransportError, match="already pending"):
        engine.recv(TransferId("a"), [Region("b", 1, 1)], timeout_s=1)


def _start_peer(backend: str, role: str, address: str, count: int,
                size: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVT_BACKEND": backend, "KVT_ROLE": role,
           "KVT_ADDRESS": address, "KVT_NAMESPACE": NAMESPACE.hex(), "KVT_COUNT": str(count),
           "KVT_SIZE": str(size)}
    return subprocess.Popen([sys.executable, "-m", "tests.transport.peer_process"], cwd=REPO,
                            env=env, stdout=subprocess.PIPE, text=True)


def _post_all(receiver, prefix: str, count: int, size: int, timeout_s: float) -> bytearray:
    dst = bytearray(count * size)
    receiver.register_buffer(prefix, memoryview(dst))
    for i in range(count):
        receiver.recv(TransferId(f"t{i}"), [Region(prefix, i * size, size)], timeout_s=timeout_s)
    return dst


def _failed_by_deadline_or_dead_sender(error: str) -> bool:
    return "deadline" in error or ("read from" in error and "failed" in error)


def test_peer_killed_mid_transfer_fails_by_deadline_and_others_still_work(make_engine, backend):
    receiver = make_engine()
    count, size, timeout_s = 40, 1 << 20, 5.0
    dst = bytearray(count * size)
    receiver.register_buffer("first", memoryview(dst))

    def post(ids: range) -> None:
        for i in ids:
            receiver.recv(TransferId(f"t{i}"), [Region("first", i * size, size)], timeout_s)

    post(range(10))  # the sender stalls at t10, offered but not received, if not killed before
    start = time.monotonic()
    child = _start_peer(backend, "send", receiver.address, count, size)
    try:
        assert child.stdout.readline().strip() == "connected"
        for _ in range(3):  # let a few transfers through, then kill it in the middle
            assert child.stdout.readline().startswith("sent")
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(10)
    post(range(10, count))  # matches the dead sender's last offer, then waits in vain
    results = wait_results(receiver, count, timeout_s=timeout_s + 2)
    assert time.monotonic() - start < timeout_s + 2
    done = [r for r in results if r.ok]
    assert 3 <= len(done) <= 10
    # Each receive fails at its deadline, or sooner where the backend saw its read from the
    # dead sender fail (Mooncake, when the kill cut a read short).
    assert all(_failed_by_deadline_or_dead_sender(r.error) for r in results if not r.ok)
    for r in done:
        i = int(r.transfer_id[1:])
        assert dst[i * size:(i + 1) * size] == payload(i, size)
    # Another peer (a new process) gets everything through the same receiver.
    second = _post_all(receiver, "second", 4, 1000, timeout_s=20)
    child = _start_peer(backend, "send", receiver.address, 4, 1000)
    try:
        assert all(r.ok for r in wait_results(receiver, 4, timeout_s=20))
    finally:
        child.wait(20)
    assert second == b"".join(payload(i, 1000) for i in range(4))


def test_receiver_killed_mid_transfer_fails_sends_by_deadline_and_frees_buffers(make_engine,
                                                                              backend):
    sender = make_engine()
    count, size, timeout_s = 40, 1 << 20, 6.0
    sender.register_buffer("src", memoryview(bytearray(b"".join(
        payload(i, size) for i in range(count)))))
    child = _start_peer(backend, "recv", "", count, size)
    try:
        peer = sender.connect(child.stdout.readline().strip(), timeout_s=10)
        start = time.monotonic()
        for i in range(count):
            sender.send(peer, TransferId(f"t{i}"), [Region("src", i * size, size)], timeout_s)
        first = child.stdout.readline().split()
        assert first[0] == "received" and first[2] == "True"
        os.kill(child.pid, signal.SIGKILL)
    finally:
        child.kill()
        child.wait(10)
    results = wait_results(sender, count, timeout_s=timeout_s + 2)
    assert time.monotonic() - start < timeout_s + 2
    # Some sends fail with the receiver gone. (The first may too: its bytes arrived, but on a
    # loaded machine its acknowledgement can be cut off by the kill.)
    assert not all(r.ok for r in results), [r.ok for r in results]
    sender.unregister_buffer("src")  # every region was let go of, even frames queued to the dead
    # The sender reaches a live receiver afterwards.
    receiver = make_engine()
    src, dst = bytearray(os.urandom(5000)), bytearray(5000)
    sender.register_buffer("again", memoryview(src))
    receiver.register_buffer("dst", memoryview(dst))
    receiver.recv(TransferId("again"), [Region("dst", 0, 5000)], timeout_s=10)
    sender.send(sender.connect(receiver.address, timeout_s=5), TransferId("again"),
                [Region("again", 0, 5000)], timeout_s=10)
    assert wait_results(receiver, 1, timeout_s=10)[0].ok and dst == src


def test_shutdown_with_transfers_in_flight_returns_within_its_deadline(make_engine):
    receiver, sender, peer = _pair(make_engine)
    sender.register_buffer("src", memoryview(bytearray(1 << 20)))
    receiver.register_buffer("dst", memoryview(bytearray(1 << 20)))
    for i in range(8):  # offered, never received; posted, never offered
        sender.send(peer, TransferId(f"s{i}"), [Region("src", 0, 1 << 20)], timeout_s=60)
        receiver.recv(TransferId(f"r{i}"), [Region("dst", 0, 1 << 20)], timeout_s=60)
    for engine in (sender, receiver):
        start = time.monotonic()
        engine.shutdown(timeout_s=1.0)
        # The deadline, plus a margin for a machine busy with other work.
        assert time.monotonic() - start < 1.5
        results = wait_results(engine, 8, timeout_s=1.0)
        assert len(results) == 8 and not any(r.ok for r in results)
    with pytest.raises(TransportError, match="shut down"):
        sender.send(peer, TransferId("late"), [Region("src", 0, 1)], timeout_s=1)


def test_thousands_of_transfers_queued_at_once_all_complete(make_engine):
    # More than zmq's default queue limit (1000 messages) in flight on one connection.
    receiver, sender, peer = _pair(make_engine)
    n, size = 3000, 64
    src = bytearray(os.urandom(n * size))
    dst = bytearray(n * size)
    sender.register_buffer("src", memoryview(src))
    receiver.register_buffer("dst", memoryview(dst))
    for i in range(n):
        sender.send(peer, TransferId(f"q{i}"), [Region("src", i * size, size)], timeout_s=60)
    for i in range(n):
        receiver.recv(TransferId(f"q{i}"), [Region("dst", i * size, size)], timeout_s=60)
    assert all(r.ok for r in wait_results(receiver, n, timeout_s=60))
    assert all(r.ok for r in wait_results(sender, n, timeout_s=10))
    assert dst == src
