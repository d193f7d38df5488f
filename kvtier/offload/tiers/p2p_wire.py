"""The p2p tier's control protocol, and the client that asks one peer for chunks.

One DEALER (client) to one ROUTER (the peer's serving side), msgpack headers checked against
`MESSAGES` by the transport's decoder (nothing is unpickled), the transport's handshake first:

    client                                      server
    hello / proof                          ->   hello_ack / welcome   (or refused: namespace,
                                                secret; see kvtier/transport/handshake.py)
    has {n, keys}                          ->   have {n, found}       which keys it holds ready
    get {n, key}                           ->   chunk {n} + one frame (the checked chunk format
                                                of offload/chunk_format.py) or missing {n}

`n` numbers a client's requests: an answer that arrives after its request gave up is dropped,
never taken for a later one. Every wait has a deadline; a client that timed out closes its
socket (dropping anything queued) and handshakes again on its next request.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import msgpack
import zmq

from kvtier.transport import protocol
from kvtier.transport.base import MalformedMessageError
from kvtier.transport.handshake import Dialing, LocalIdentity, Refusal

_HANDSHAKE = ("hello", "hello_ack", "proof", "welcome", "refused")
MESSAGES: dict[str, dict[str, tuple[type, ...]]] = {
    **{kind: protocol.MESSAGES[kind] for kind in _HANDSHAKE},
    "has": {"n": (int,), "keys": (list,)},
    "have": {"n": (int,), "found": (list,)},
    "get": {"n": (int,), "key": (bytes,)},
    "chunk": {"n": (int,)},
    "missing": {"n": (int,)},
}
# Keys one `has` may carry (the decoder's array limit).
MAX_KEYS = protocol.MAX_REGIONS


class PeerRefused(Exception):
    """The peer refused the handshake; `refusal.code` says why (namespace, secret, protocol)."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.reason)
        self.refusal = refusal


def encode(kind: str, **fields: Any) -> bytes:
    assert fields.keys() == MESSAGES[kind].keys(), (kind, fields.keys())
    return msgpack.packb({"t": kind, **fields}, use_bin_type=True)


def decode(frame: bytes | memoryview) -> dict[str, Any]:
    """A checked header; raises MalformedMessageError for anything but one of `MESSAGES`."""
    message = protocol.decode(frame, MESSAGES)
    items = message.get("keys", message.get("found", []))
    wanted = bytes if "keys" in message else bool
    if not all(isinstance(item, wanted) for item in items):
        raise MalformedMessageError(f"{message['t']} holds an item that is not {wanted.__name__}")
    return message


class PeerClient:
    """Requests to one peer, one at a time (a lock serializes the tier's threads)."""

    def __init__(self, ctx: zmq.Context, address: str, local: LocalIdentity,
                 max_reply_bytes: int, connect_timeout_s: float, timeout_s: float) -> None:
        self.address = address
        self._ctx, self._local = ctx, local
        self._max_reply_bytes = max_reply_bytes
        self._connect_timeout_s, self._timeout_s = connect_timeout_s, timeout_s
        self._lock = threading.Lock()
        self._socket: zmq.Socket | None = None
        self._next_n = 0
        # time.monotonic() until which this peer is not asked (it failed a request).
        self.down_until = 0.0

    def has(self, keys: Sequence[bytes]) -> list[bool]:
        """Which of `keys` the peer holds ready in host memory."""
        found = self._request("has", {"keys": list(keys)}, ("have",))[0]["found"]
        if len(found) != len(keys):
            raise MalformedMessageError(f"asked about {len(keys)} keys, told about {len(found)}")
        return found

    def get(self, key: bytes) -> bytes | None:
        """`key`'s chunk in the checked chunk format (not yet checked), or None if the peer
        does not hold it (any more)."""
        answer, frames = self._request("get", {"key": key}, ("chunk", "missing"))
        if answer["t"] == "missing":
            return None
        if len(frames) != 1:
            raise MalformedMessageError(f"chunk answer with {len(frames)} payload frames")
        return frames[0]

    def _request(self, kind: str, fields: dict[str, Any],
                 answers: tuple[str, ...]) -> tuple[dict[str, Any], list[bytes]]:
        with self._lock:
            try:
                socket = self._socket or self._connect()
                self._next_n += 1
                socket.send(encode(kind, n=self._next_n, **fields))
                return self._answer(socket, self._next_n, answers)
            except BaseException:
                self.close()
                raise

    def _answer(self, socket: zmq.Socket, n: int,
                answers: tuple[str, ...]) -> tuple[dict[str, Any], list[bytes]]:
        deadline = time.monotonic() + self._timeout_s
        while True:
            header, frames = _receive(socket, deadline, self.address)
            message = decode(header)
            if message["t"] == "refused":
                raise PeerRefused(Refusal(message["code"], message["reason"]))
            if message["t"] not in answers:
                raise MalformedMessageError(f"{message['t']} in answer to a request")
            if message["n"] == n:
                return message, frames
            # An answer to a request that gave up earlier: not ours, drop it.

    def _connect(self) -> zmq.Socket:
        """A new connection with the handshake done, within connect_timeout_s."""
        socket = self._ctx.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.MAXMSGSIZE, self._max_reply_bytes)
        self._socket = socket
        socket.connect(self.address)
        deadline = time.monotonic() + self._connect_timeout_s
        dialing = Dialing(self._local, self.address)
        socket.send(dialing.hello())
        reply = decode(_receive(socket, deadline, self.address)[0])
        if reply["t"] != "hello_ack":
            raise _refusal_or_error(reply)
        proof, refusal = dialing.on_hello_ack(reply)
        socket.send(proof)
        if refusal is not None:
            raise PeerRefused(refusal)
        reply = decode(_receive(socket, deadline, self.address)[0])
        if reply["t"] != "welcome":
            raise _refusal_or_error(reply)
        return socket

    def close(self) -> None:
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None


def _receive(socket: zmq.Socket, deadline: float, address: str) -> tuple[bytes, list[bytes]]:
    """The next message's header frame and its other frames, or TimeoutError at `deadline`."""
    remaining_ms = int(1000 * (deadline - time.monotonic()))
    if remaining_ms <= 0 or not socket.poll(remaining_ms, zmq.POLLIN):
        raise TimeoutError(f"p2p peer {address} did not answer in time")
    header, *frames = socket.recv_multipart()
    return header, frames


def _refusal_or_error(message: dict[str, Any]) -> Exception:
    if message["t"] == "refused":
        return PeerRefused(Refusal(message["code"], message["reason"]))
    return MalformedMessageError(f"{message['t']} during the handshake")
