"""What only the zmq backend does: zero-copy frames handed back to the caller only after zmq
let go of them, even when the peer stops reading."""

from __future__ import annotations

import os
import threading
import time

import zmq
import zmq.utils.garbage as zmq_garbage

from kvtier.transport import Region, TransferId, TransportConfig, protocol
from kvtier.transport.zmq_engine import ZmqTransferEngine
from tests.transport.transport_helpers import NAMESPACE, wait_results


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
        source, header = stuck.recv_multipart()
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
            answer("offer", "accept", id=f"big{i}")
        start = time.monotonic()
        results = wait_results(sender, 2, timeout_s=5)
        assert all(r.error for r in results) and time.monotonic() - start < 3.0
        assert not zmq_garbage.gc.refs  # zmq holds no frame of the buffer any more
        sender.unregister_buffer("src")
    finally:
        sender.shutdown(timeout_s=2)
        stuck.close()
        ctx.term()
