"""What only the Mooncake backend does: a pull that a plain Mooncake reader can serve itself,
a sender that keeps its source until the reader is done (or a grace past its deadline), a
receiver that survives pulls it cannot read, and clear errors for a missing wheel or
mismatched backends."""

from __future__ import annotations

import ctypes
import logging
import os
import socket
import sys
import time

import pytest
import zmq

from kvtier.transport import (
    BackendUnavailableError,
    Region,
    TransferId,
    TransportConfig,
    TransportError,
    make_transfer_engine,
    protocol,
)
from kvtier.transport.mooncake_engine import ABORT_GRACE_S
from tests.transport.transport_helpers import (
    BACKENDS,
    NAMESPACE,
    UNAVAILABLE,
    greet,
    wait_results,
    wait_until,
    welcome,
)

needs_mooncake = pytest.mark.skipif("mooncake" in UNAVAILABLE,
                                    reason=UNAVAILABLE.get("mooncake", ""))


@pytest.fixture
def engines():
    """backend name -> a new engine of it; all shut down at the end."""
    made = []

    def make(backend: str):
        made.append(BACKENDS[backend](TransportConfig(namespace=NAMESPACE)))
        return made[-1]

    yield make
    for engine in made:
        engine.shutdown(timeout_s=2.0)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_missing_wheel_is_a_typed_error_naming_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "mooncake", None)  # what an absent package looks like
    monkeypatch.setitem(sys.modules, "mooncake.engine", None)
    with pytest.raises(BackendUnavailableError, match=r"pip install 'kvtier\[mooncake\]'"):
        make_transfer_engine(TransportConfig(namespace=NAMESPACE, backend="mooncake"))


@needs_mooncake
def test_a_wildcard_bind_host_is_refused():
    with pytest.raises(TransportError, match="wildcard"):
        make_transfer_engine(TransportConfig(NAMESPACE, bind_host="0.0.0.0", backend="mooncake"))


def _listening_hosts(port: int) -> set[str]:
    """The addresses a TCP socket of this machine listens on at `port` (from /proc/net)."""
    hosts = set()
    for name in ("tcp", "tcp6"):
        with open(f"/proc/net/{name}") as f:
            for line in f.read().splitlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                host, local_port = local.split(":")
                if state == "0A" and int(local_port, 16) == port:  # 0A: LISTEN
                    hosts.add("*" if set(host) == {"0"} else host)
    return hosts


@needs_mooncake
@pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="reads Linux's /proc/net")
def test_the_start_warns_that_mooncakes_ports_listen_on_every_interface(engines, caplog):
    with caplog.at_level(logging.WARNING, logger="kvtier.transport.mooncake_engine"):
        engine = engines("mooncake")
    rpc_port = engine._mooncake.get_rpc_port()
    assert [r.getMessage() for r in caplog.records] == [
        f"transport: Mooncake's handshake port {rpc_port} and its data port listen on all "
        f"interfaces, whatever bind_host says, and let anyone who reaches them read and "
        f"overwrite every registered buffer, without the handshake or the secret: firewall "
        f"them to the peers, or use the zmq transport"]
    # What the warning says, although bind_host is 127.0.0.1 (if a Mooncake release binds
    # bind_host, pass it on and drop the warning).
    assert engine.config.bind_host == "127.0.0.1" and _listening_hosts(rpc_port) == {"*"}


@needs_mooncake
def test_the_pull_is_all_a_mooncake_reader_needs_and_the_sender_waits_for_it(engines,
                                                                             raw_peer):
    from mooncake.engine import TransferEngine

    sender = engines("mooncake")
    data = os.urandom(300_000)
    sender.register_buffer("src", memoryview(bytearray(data)))
    router = raw_peer(zmq.ROUTER)
    [peer] = welcome(router, sender)
    timeout_s = 0.5
    start = time.monotonic()
    sender.send(peer, TransferId("t"), [Region("src", 1000, 5000), Region("src", 90_000, 7)],
                timeout_s=timeout_s)
    source, header = router.recv_multipart()
    pull = protocol.decode(header)
    assert pull["sizes"] == [5000, 7] and pull["addrs"][1] - pull["addrs"][0] == 89_000
    assert 0 < pull["ttl_ms"] <= timeout_s * 1000
    router.send_multipart([source, protocol.encode("accept", id="t", offset=0)])
    # A plain Mooncake engine reads the regions with what the pull says, nothing else.
    reader = TransferEngine()
    assert reader.initialize("127.0.0.1", "P2PHANDSHAKE", "tcp", "") == 0
    dst = bytearray(5007)
    base = ctypes.addressof(ctypes.c_char.from_buffer(dst))
    assert reader.register_memory(base, len(dst)) == 0
    assert reader.batch_transfer_sync_read(pull["session"], [base, base + 5000], pull["addrs"],
                                           pull["sizes"]) == 0
    assert dst == data[1000:6000] + data[90_000:90_007]
    # Memory the sender did not register is refused.
    assert reader.batch_transfer_sync_read(pull["session"], [base], [pull["addrs"][0] + 400_000],
                                           [16]) != 0
    # The reader never says done: the sender holds its source past the deadline, for the grace.
    time.sleep(timeout_s + ABORT_GRACE_S / 2 - (time.monotonic() - start))
    assert sender.get_finished() == []
    with pytest.raises(TransportError, match="pending"):
        sender.unregister_buffer("src")
    [result] = wait_results(sender, 1, timeout_s=3)
    assert "deadline" in result.error and time.monotonic() - start >= timeout_s + ABORT_GRACE_S
    sender.unregister_buffer("src")
    reader.unregister_memory(base)


@needs_mooncake
def test_a_pull_that_cannot_be_read_fails_the_receive_at_once_and_others_go_on(engines,
                                                                             raw_peer):
    receiver = engines("mooncake")
    dst = bytearray(4096)
    receiver.register_buffer("dst", memoryview(dst))
    receiver.recv(TransferId("bad"), [Region("dst", 0, 4096)], timeout_s=20)
    dealer = raw_peer(zmq.DEALER)
    greet(dealer, receiver)
    start = time.monotonic()
    dealer.send(protocol.encode("pull", id="bad", sizes=[4096],
                                session=f"127.0.0.1:{_closed_port()}", addrs=[4096],
                                ttl_ms=20_000))
    assert protocol.decode(dealer.recv())["t"] == "accept"
    reply = protocol.decode(dealer.recv())
    assert reply["t"] == "fail" and "Mooncake" in reply["error"]
    [result] = wait_results(receiver, 1, timeout_s=10)
    assert result.error == reply["error"] and time.monotonic() - start < 10
    assert dst == bytes(4096)
    # The same receiver takes an honest sender's transfer into the same buffer.
    data = _honest_transfer(engines, receiver, 0)
    assert wait_results(receiver, 1, timeout_s=20)[0].ok and dst == data


@needs_mooncake
def test_backends_must_match_and_say_so(engines):
    zmq_engine, mooncake_engine = engines("zmq"), engines("mooncake")
    for engine in (zmq_engine, mooncake_engine):
        engine.register_buffer("b", memoryview(bytearray(100)))
    # A zmq offer to a Mooncake receiver is failed at once, naming the fix.
    mooncake_engine.recv(TransferId("z"), [Region("b", 0, 100)], timeout_s=0.5)
    zmq_engine.send(zmq_engine.connect(mooncake_engine.address, timeout_s=5), TransferId("z"),
                    [Region("b", 0, 100)], timeout_s=10)
    [sent] = wait_results(zmq_engine, 1, timeout_s=5)
    assert "same transport" in sent.error
    # A pull to a zmq receiver is dropped as malformed; the send fails at its deadline.
    mooncake_engine.send(mooncake_engine.connect(zmq_engine.address, timeout_s=5),
                         TransferId("m"), [Region("b", 0, 100)], timeout_s=0.5)
    results = {r.transfer_id: r for r in wait_results(mooncake_engine, 2, timeout_s=5)}
    assert "deadline" in results["m"].error and "deadline" in results["z"].error
    wait_until(lambda: zmq_engine.stats()["malformed"] == 1)


@needs_mooncake
def test_a_sender_mooncake_cannot_reach_holds_up_only_its_own_reads(engines, raw_peer):
    receiver = engines("mooncake")
    dst = bytearray(8192)
    receiver.register_buffer("dst", memoryview(dst))
    # Takes Mooncake's handshake connection and never answers it (as a paused sender would).
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        start = time.monotonic()
        receiver.recv(TransferId("stuck"), [Region("dst", 0, 4096)], timeout_s=1.0)
        dealer = raw_peer(zmq.DEALER)
        greet(dealer, receiver)
        dealer.send(protocol.encode("pull", id="stuck", sizes=[4096],
                                    session=f"127.0.0.1:{silent.getsockname()[1]}",
                                    addrs=[4096], ttl_ms=20_000))
        assert protocol.decode(dealer.recv())["t"] == "accept"
        # Another sender's transfer to the same receiver goes through meanwhile.
        data = _honest_transfer(engines, receiver, 4096)
        results = {r.transfer_id: r for r in wait_results(receiver, 2, timeout_s=10)}
        assert results["good"].ok and dst[4096:] == data
        assert "deadline" in results["stuck"].error and time.monotonic() - start < 3.0
        assert dst[:4096] == bytes(4096)
    finally:
        silent.close()


def _honest_transfer(engines, receiver, offset: int) -> bytes:
    """4096 random bytes sent by a new Mooncake sender as transfer "good" into the receiver's
    "dst" at `offset`; the bytes (the caller waits for the result)."""
    sender = engines("mooncake")
    data = os.urandom(4096)
    sender.register_buffer("src", memoryview(bytearray(data)))
    receiver.recv(TransferId("good"), [Region("dst", offset, 4096)], timeout_s=20)
    sender.send(sender.connect(receiver.address, timeout_s=5), TransferId("good"),
                [Region("src", 0, 4096)], timeout_s=20)
    return data
