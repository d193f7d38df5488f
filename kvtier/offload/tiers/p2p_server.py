"""The serving side of the p2p tier: answers peers' `has` and `get` from this instance's host tier.

One thread owns one ROUTER socket. A connection must pass the transport's handshake (same KV
namespace, the same transport secret if any) before it is told anything. A `get` pins the
chunk's host slot (`HostCache.pin_ready`) only while its bytes are checksummed and copied into
the answer, so an eviction can never hand the slot to another chunk mid-copy; the copy is sent in
the checked chunk format, which the asking side verifies. The thread runs whether or not this
instance's engine is stepping: an idle instance still serves what it holds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, OrderedDict
from typing import Any

import zmq

from kvtier.offload.chunk_format import encode_header
from kvtier.offload.tiers.p2p_wire import decode, encode
from kvtier.transport import protocol
from kvtier.transport.base import MalformedMessageError
from kvtier.transport.handshake import Accepting, LocalIdentity, Refusal, RefusalLog

logger = logging.getLogger(__name__)

# Connections remembered (handshakes and welcomed peers); beyond this the oldest is forgotten
# and must handshake again.
_MAX_CONNECTIONS = 1024
# A handshake not finished in this time is forgotten.
_HANDSHAKE_TIMEOUT_S = 10.0
_POLL_MS = 100


class P2PServer:
    """Serves `host`'s ready chunks at `address` ("tcp://HOST:PORT") until `shutdown`."""

    def __init__(self, ctx: zmq.Context, address: str, host: Any, local: LocalIdentity,
                 chunk_secret: bytes | None) -> None:
        self._host, self._local, self._chunk_secret = host, local, chunk_secret
        self._socket = ctx.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.LINGER, 0)
        # Requests are one small header: anything larger is refused by zmq before allocation.
        self._socket.setsockopt(zmq.MAXMSGSIZE, protocol.MAX_HEADER_BYTES)
        try:
            self._socket.bind(address)
        except zmq.ZMQError as exc:
            self._socket.close()
            raise ValueError(f"p2p tier: cannot listen on {address}: {exc}; choose another "
                             f"p2p_listen port") from None
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)
        self._connections: OrderedDict[bytes, Accepting] = OrderedDict()
        # served, missing, malformed, internal_errors, refused_<code>: what peers asked and
        # were told.
        self.counts: Counter[str] = Counter()
        self._refusals = RefusalLog(self.counts)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kvtier-p2p-serve", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stopping:
            if not self._socket.poll(_POLL_MS, zmq.POLLIN):
                continue
            identity, *frames = self._socket.recv_multipart()
            try:
                if len(frames) != 1:
                    raise MalformedMessageError(f"{len(frames)} frames, expected one header")
                reply = self._handle(identity, decode(frames[0]))
            except MalformedMessageError as exc:
                self.counts["malformed"] += 1
                logger.debug("p2p tier: dropped a malformed request: %s", exc)
                continue
            except Exception:  # one bad request must not stop the serving of every other
                self.counts["internal_errors"] += 1
                logger.exception("p2p tier: a request failed")
                continue
            self._socket.send_multipart([identity, *reply], copy=False)
        self._socket.close(linger=0)

    def _handle(self, identity: bytes, message: dict[str, Any]) -> list[bytes]:
        kind = message["t"]
        if kind == "hello":
            return [self._hello(identity, message)]
        connection = self._connections.get(identity)
        if connection is not None and kind == "proof" and not connection.welcomed:
            reply, refusal = connection.on_proof(message)
            self._refused(identity, connection, refusal)
            return [reply]
        if connection is None or not connection.welcomed or kind not in ("has", "get"):
            refusal = Refusal(protocol.REFUSED_PROTOCOL, f"{kind} before the handshake ended")
            self._refused(identity, connection, refusal)
            return [protocol.encode("refused", code=refusal.code, reason=refusal.reason)]
        if kind == "has":
            found = [self._host.is_ready(key) for key in message["keys"]]
            return [encode("have", n=message["n"], found=found)]
        return self._get(message["n"], message["key"])

    def _hello(self, identity: bytes, message: dict[str, Any]) -> bytes:
        self._forget_stale()
        connection = Accepting(self._local, time.monotonic())
        reply, refusal = connection.on_hello(message)
        if refusal is None:
            self._connections[identity] = connection
            self._connections.move_to_end(identity)
            while len(self._connections) > _MAX_CONNECTIONS:
                self._connections.popitem(last=False)
        self._refused(identity, connection, refusal)
        return reply

    def _refused(self, identity: bytes, connection: Accepting | None,
                 refusal: Refusal | None) -> None:
        if refusal is not None:
            self._connections.pop(identity, None)
            # By the engine id it said hello with: a client retries on a new socket (a new
            # routing id) each time, and must not be logged each time.
            self._refusals.record(refusal, connection.peer if connection else "(no hello)")

    def _forget_stale(self) -> None:
        cutoff = time.monotonic() - _HANDSHAKE_TIMEOUT_S
        for identity in [i for i, c in self._connections.items()
                         if not c.welcomed and c.started < cutoff]:
            del self._connections[identity]

    def _get(self, n: int, key: bytes) -> list[bytes]:
        view = self._host.pin_ready(key)
        if view is None:
            self.counts["missing"] += 1
            return [encode("missing", n=n)]
        try:
            chunk = b"".join((encode_header(key, view, self._chunk_secret), view))
        finally:
            self._host.complete_load(key)
        self.counts["served"] += 1
        return [encode("chunk", n=n), chunk]

    def shutdown(self, timeout_s: float) -> bool:
        """Stop serving; True if the thread ended within `timeout_s`."""
        self._stopping = True
        self._thread.join(timeout_s)
        return not self._thread.is_alive()
