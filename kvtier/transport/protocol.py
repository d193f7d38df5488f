"""The wire protocol: one msgpack header frame per message, then the payload frames of an
`offer` or a `data`.

Every header is a msgpack map with a type `t` and exactly the fields `MESSAGES` lists for it,
each of the listed types. Anything else (not msgpack, extension types, unknown or missing
fields, oversized values) is a MalformedMessageError and is dropped: nothing that arrives is
ever unpickled or evaluated.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import msgpack

from kvtier.transport.base import MalformedMessageError

# 2: eager offers and transfers cut into several data messages.
PROTOCOL_VERSION = 2
MAX_HEADER_BYTES = 64 * 1024
# Regions of one side of a transfer: their sizes must fit in one header.
MAX_REGIONS = 4096
NONCE_BYTES = 32
# A transfer's first bytes go with its offer (all of a transfer this small); the rest goes as
# data messages of DATA_MESSAGE_BYTES (see zmq_transfer.py).
EAGER_BYTES = 4 << 20
DATA_MESSAGE_BYTES = 4 << 20
# No frame of this protocol is larger: a payload frame is (part of) one message's bytes.
MAX_FRAME_BYTES = max(EAGER_BYTES, DATA_MESSAGE_BYTES, MAX_HEADER_BYTES)

_BYTES = (bytes,)
_STR = (str,)
_SIZES = (list,)
_OPTIONAL_BYTES = (bytes, type(None))
MESSAGES: dict[str, dict[str, tuple[type, ...]]] = {
    # Handshake, initiator -> acceptor -> initiator -> acceptor -> initiator.
    "hello": {"v": (int,), "engine": _STR, "ns": _STR, "nonce": _BYTES, "auth": (bool,)},
    "hello_ack": {"engine": _STR, "ns": _STR, "nonce": _BYTES, "auth": (bool,),
                  "proof": _OPTIONAL_BYTES},
    "proof": {"proof": _OPTIONAL_BYTES},
    "welcome": {},
    "refused": {"code": _STR, "reason": _STR},
    # A transfer: the sender offers it (within `ttl_ms`, its time left), with the first bytes
    # as payload frames when it is small enough (eager); the receiver, once its recv is posted,
    # accepts from `offset` (the bytes it kept); the sender sends the rest as `data` messages
    # of a few MiB, each saying where its payload starts; the receiver says done once it has
    # every byte. Either side may fail it.
    "offer": {"id": _STR, "sizes": _SIZES, "ttl_ms": (int,)},
    "accept": {"id": _STR, "offset": (int,)},
    "data": {"id": _STR, "offset": (int,)},
    "done": {"id": _STR},
    "fail": {"id": _STR, "error": _STR},
    # A one-sided backend's offer: the receiver reads `sizes` bytes at `addrs` of the sender's
    # registered memory itself, from `session` (the backend's data endpoint), within `ttl_ms`
    # (the sender's time left), then answers done or fail. It accepts when the read starts.
    "pull": {"id": _STR, "sizes": _SIZES, "session": _STR, "addrs": _SIZES, "ttl_ms": (int,)},
}
# Refusal codes, so the initiator raises the matching error type.
REFUSED_NAMESPACE = "namespace"
REFUSED_SECRET = "secret"
REFUSED_PROTOCOL = "protocol"
REFUSAL_CODES = (REFUSED_NAMESPACE, REFUSED_SECRET, REFUSED_PROTOCOL)


def encode(kind: str, **fields: Any) -> bytes:
    assert fields.keys() == MESSAGES[kind].keys(), (kind, fields.keys())
    return msgpack.packb({"t": kind, **fields}, use_bin_type=True)


def decode(frame: bytes | memoryview,
           messages: dict[str, dict[str, tuple[type, ...]]] = MESSAGES) -> dict[str, Any]:
    """The checked header in `frame`, one of `messages` (this protocol's by default, or another
    protocol's that shares the handshake); raises MalformedMessageError for anything else."""
    if len(frame) > MAX_HEADER_BYTES:
        raise MalformedMessageError(f"header of {len(frame)} bytes (limit {MAX_HEADER_BYTES})")
    try:
        message = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_ext_len=0,
                                  max_bin_len=1024, max_str_len=4096, max_map_len=16,
                                  max_array_len=MAX_REGIONS)
    except (ValueError, msgpack.UnpackException) as exc:
        raise MalformedMessageError(f"header is not msgpack: {exc}") from None
    if not isinstance(message, dict):
        raise MalformedMessageError("header is not a map")
    kind = message.pop("t", None)
    schema = messages.get(kind) if isinstance(kind, str) else None
    if schema is None:
        raise MalformedMessageError(f"unknown message type {kind!r}")
    if message.keys() != schema.keys():
        raise MalformedMessageError(f"{kind} has fields {sorted(message)}, expected "
                                    f"{sorted(schema)}")
    for name, types in schema.items():
        # bool is an int in Python; a field that wants an int never takes True.
        if not isinstance(message[name], types) or (types == (int,)
                                                    and isinstance(message[name], bool)):
            raise MalformedMessageError(f"{kind}.{name} has type {type(message[name]).__name__}")
    if kind in ("offer", "pull"):
        _check_sizes(message["sizes"])
        if message["ttl_ms"] <= 0:
            raise MalformedMessageError(f"{kind}.ttl_ms must be > 0")
    if kind == "pull":
        _check_pull(message)
    if kind in ("accept", "data") and message["offset"] < 0:
        raise MalformedMessageError(f"{kind}.offset must be >= 0")
    message["t"] = kind
    return message


def _check_sizes(sizes: list[Any]) -> None:
    if not sizes or not all(type(size) is int and size >= 0 for size in sizes):
        raise MalformedMessageError("offer.sizes must be a non-empty list of byte counts")


def _check_pull(message: dict[str, Any]) -> None:
    addrs = message["addrs"]
    if len(addrs) != len(message["sizes"]) or not all(
            type(addr) is int and addr >= 0 for addr in addrs):
        raise MalformedMessageError("pull.addrs must hold one address per size")


def prove(secret: bytes, role: str, my_nonce: bytes, their_nonce: bytes, namespace: str,
          initiator: str, acceptor: str) -> bytes:
    """HMAC that `role` ("initiator" / "acceptor") knows `secret`, bound to this connection:
    both nonces (no replay), both engine ids and the namespace (no relaying to a third peer)."""
    text = msgpack.packb([role, my_nonce, their_nonce, namespace, initiator, acceptor],
                         use_bin_type=True)
    return hmac.new(secret, text, hashlib.sha256).digest()


def proof_matches(expected: bytes, got: bytes | None) -> bool:
    return got is not None and hmac.compare_digest(expected, got)
