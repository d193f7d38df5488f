"""Shared pieces of the transport tests: backends to run every contract test against, engines
that are shut down after each test, waiting for results with a deadline, and both sides of the
handshake for a raw zmq socket that stands in for a peer."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import socket
import struct
import threading
import time
from collections.abc import Callable

import zmq

from kvtier.transport import (
    TransferEngine,
    TransferResult,
    TransportConfig,
    make_transfer_engine,
    protocol,
)

NAMESPACE = hashlib.sha256(b"kvtier transport tests").digest()
OTHER_NAMESPACE = hashlib.sha256(b"another model").digest()
SECRET = b"0123456789abcdef-test-secret"


def _engine_of(backend: str) -> Callable[[TransportConfig], TransferEngine]:
    return lambda config: make_transfer_engine(dataclasses.replace(config, backend=backend))


# name -> (config -> engine). A new backend adds itself here and runs every contract test.
BACKENDS: dict[str, Callable[[TransportConfig], TransferEngine]] = {
    "zmq": _engine_of("zmq"),
    "mooncake": _engine_of("mooncake"),
}


def _unavailable() -> dict[str, str]:
    try:
        import mooncake.engine  # noqa: F401
    except ImportError as exc:
        return {"mooncake": f"Mooncake's transfer engine cannot be imported here ({exc}); "
                            f"pip install 'kvtier[mooncake]' (and apt-get install libibverbs1)"}
    return {}


# Backends whose package cannot be imported here, and why their tests are skipped.
UNAVAILABLE: dict[str, str] = _unavailable()


def wait_results(engine: TransferEngine, count: int, timeout_s: float) -> list[TransferResult]:
    """At least `count` results of `engine` (all it had), in completion order; fails past
    `timeout_s`."""
    results: list[TransferResult] = []
    deadline = time.monotonic() + timeout_s
    while len(results) < count:
        left = deadline - time.monotonic()
        assert left > 0, f"only {len(results)} of {count} results: {results}"
        results += engine.get_finished(timeout_s=left)
    return results


def wait_until(condition: Callable[[], bool], timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def greet(dealer: zmq.Socket, receiver: TransferEngine) -> None:
    """The initiator's side of the handshake, without a secret."""
    dealer.connect(receiver.address)
    dealer.send(protocol.encode("hello", v=protocol.PROTOCOL_VERSION, engine="raw",
                                ns=NAMESPACE.hex(), nonce=os.urandom(32), auth=False))
    assert protocol.decode(dealer.recv())["t"] == "hello_ack"
    dealer.send(protocol.encode("proof", proof=None))
    assert protocol.decode(dealer.recv())["t"] == "welcome"


def welcome(router: zmq.Socket, sender: TransferEngine) -> list:
    """The acceptor's side of the handshake for `sender.connect`; returns [peer id]."""
    connected: list = []
    port = router.bind_to_random_port("tcp://127.0.0.1")
    connecting = threading.Thread(target=lambda: connected.append(
        sender.connect(f"tcp://127.0.0.1:{port}", timeout_s=5)))
    connecting.start()
    source, _ = router.recv_multipart()
    router.send_multipart([source, protocol.encode(
        "hello_ack", engine="raw", ns=NAMESPACE.hex(), nonce=os.urandom(32), auth=False,
        proof=None)])
    router.recv_multipart()
    router.send_multipart([source, protocol.encode("welcome")])
    connecting.join()
    return connected


def zmtp_dealer(address: str) -> socket.socket:
    """A raw TCP connection that has done ZMTP 3.0's greeting as a DEALER: a peer that sends
    frames as it likes, none of them checked or buffered by a zmq of its own."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    conn = socket.create_connection((host, int(port)), timeout=5)
    # signature, version 3.0, NULL mechanism, as-server 0, filler
    conn.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32))
    greeting = b""
    while len(greeting) < 64:
        greeting += conn.recv(64 - len(greeting))
    ready = b"\x05READY\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    conn.sendall(b"\x04" + bytes([len(ready)]) + ready)  # a short command frame
    return conn
