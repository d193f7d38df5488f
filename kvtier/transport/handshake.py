"""Both sides of the handshake that runs before any KV moves over a connection.

    initiator                                   acceptor
    hello {v, engine, ns, nonce_i, auth}  ->
                                          <-    hello_ack {engine, ns, nonce_a, auth, proof_a}
    proof {proof_i}                       ->
                                          <-    welcome  (or refused {code, reason} at any step)

`ns` is the hex of `KVIdentity.namespace`; either side refuses a peer whose digest differs. With
a shared secret (`auth`), each side proves it with an HMAC over both fresh nonces, both engine
ids and the namespace, so a proof is good for this connection only; a side without the secret
is refused by one with it. These classes hold the state and pick the reply; the engine's I/O
loop owns the sockets.
"""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from dataclasses import dataclass, field

from kvtier.transport import protocol
from kvtier.transport.base import (
    AuthenticationError,
    HandshakeError,
    NamespaceMismatchError,
    PeerId,
)

logger = logging.getLogger(__name__)
# (code, peer) pairs RefusalLog remembers having logged; the least recent is forgotten beyond.
_MAX_LOGGED = 1024

_ERRORS: dict[str, type[HandshakeError]] = {
    protocol.REFUSED_NAMESPACE: NamespaceMismatchError,
    protocol.REFUSED_SECRET: AuthenticationError,
    protocol.REFUSED_PROTOCOL: HandshakeError,
}


@dataclass(frozen=True)
class LocalIdentity:
    engine_id: PeerId
    namespace_hex: str
    secret: bytes | None


@dataclass(frozen=True)
class Refusal:
    """Why a handshake ended: the code sent to the peer and the line logged."""

    code: str
    reason: str

    def error(self) -> HandshakeError:
        return _ERRORS[self.code](self.reason)


class RefusalLog:
    """Counts refusals by code and logs the first of each code per peer (its engine id or
    address, which stay the same across its retries), so one misconfigured peer that retries
    forever fills no logs; remembers at most _MAX_LOGGED of them."""

    def __init__(self, counts: dict[str, int]) -> None:
        self._counts = counts
        self._logged: OrderedDict[tuple[str, str], None] = OrderedDict()

    def record(self, refusal: Refusal, peer: str) -> None:
        self._counts[f"refused_{refusal.code}"] += 1
        key = (refusal.code, peer)
        if key in self._logged:
            self._logged.move_to_end(key)
            return
        self._logged[key] = None
        if len(self._logged) > _MAX_LOGGED:
            self._logged.popitem(last=False)
        logger.warning("transport: refused peer %s: %s", peer[:80], refusal.reason)


def _check_peer(local: LocalIdentity, namespace_hex: str, auth: bool) -> Refusal | None:
    if namespace_hex != local.namespace_hex:
        return Refusal(protocol.REFUSED_NAMESPACE,
                       f"KV namespace {namespace_hex[:16]}... differs from ours "
                       f"{local.namespace_hex[:16]}... (other weights, dtype, block size or "
                       f"layout): its KV is not interchangeable with ours")
    if auth != (local.secret is not None):
        return Refusal(protocol.REFUSED_SECRET,
                       "only one side has a shared secret; set the same "
                       "KVTIER_TRANSPORT_SECRET (or _FILE) on both")
    return None


@dataclass
class Dialing:
    """The initiator's side of one handshake."""

    local: LocalIdentity
    address: str
    nonce: bytes = field(default_factory=lambda: os.urandom(protocol.NONCE_BYTES))
    peer: PeerId | None = None

    def hello(self) -> bytes:
        return protocol.encode("hello", v=protocol.PROTOCOL_VERSION, engine=self.local.engine_id,
                               ns=self.local.namespace_hex, nonce=self.nonce,
                               auth=self.local.secret is not None)

    def on_hello_ack(self, msg: dict) -> tuple[bytes, Refusal | None]:
        """The reply to send, and the refusal when the acceptor failed our checks."""
        self.peer = PeerId(msg["engine"])
        refusal = _check_peer(self.local, msg["ns"], msg["auth"])
        proof = None
        if refusal is None and self.local.secret is not None:
            expected = protocol.prove(self.local.secret, "acceptor", msg["nonce"], self.nonce,
                                      self.local.namespace_hex, self.local.engine_id, self.peer)
            if not protocol.proof_matches(expected, msg["proof"]):
                refusal = Refusal(protocol.REFUSED_SECRET,
                                  f"peer {self.address} did not prove the shared secret")
            proof = protocol.prove(self.local.secret, "initiator", self.nonce, msg["nonce"],
                                   self.local.namespace_hex, self.local.engine_id, self.peer)
        if refusal is not None:
            return protocol.encode("refused", code=refusal.code, reason=refusal.reason), refusal
        return protocol.encode("proof", proof=proof), None


@dataclass
class Accepting:
    """The acceptor's side of one handshake (one connection, by its zmq routing id)."""

    local: LocalIdentity
    started: float
    peer: PeerId | None = None
    their_nonce: bytes = b""
    nonce: bytes = field(default_factory=lambda: os.urandom(protocol.NONCE_BYTES))
    welcomed: bool = False

    def on_hello(self, msg: dict) -> tuple[bytes, Refusal | None]:
        self.peer, self.their_nonce = PeerId(msg["engine"]), msg["nonce"]
        refusal = (Refusal(protocol.REFUSED_PROTOCOL, f"protocol version {msg['v']}, ours is "
                           f"{protocol.PROTOCOL_VERSION}") if msg["v"] != protocol.PROTOCOL_VERSION
                   else _check_peer(self.local, msg["ns"], msg["auth"]))
        if refusal is not None:
            return protocol.encode("refused", code=refusal.code, reason=refusal.reason), refusal
        proof = None
        if self.local.secret is not None:
            proof = protocol.prove(self.local.secret, "acceptor", self.nonce, self.their_nonce,
                                   self.local.namespace_hex, self.peer, self.local.engine_id)
        return protocol.encode("hello_ack", engine=self.local.engine_id,
                               ns=self.local.namespace_hex, nonce=self.nonce,
                               auth=self.local.secret is not None, proof=proof), None

    def on_proof(self, msg: dict) -> tuple[bytes, Refusal | None]:
        if self.local.secret is not None:
            expected = protocol.prove(self.local.secret, "initiator", self.their_nonce,
                                      self.nonce, self.local.namespace_hex, self.peer,
                                      self.local.engine_id)
            if not protocol.proof_matches(expected, msg["proof"]):
                refusal = Refusal(protocol.REFUSED_SECRET,
                                  f"peer {self.peer} did not prove the shared secret")
                return protocol.encode("refused", code=refusal.code,
                                       reason="did not prove the shared secret"), refusal
        self.welcomed = True
        return protocol.encode("welcome"), None
