"""Transfer engine options, and the shared secret read from the environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvtier.transport import protocol

# The secret never comes from the command line, where other users of the machine can read it.
SECRET_ENV = "KVTIER_TRANSPORT_SECRET"
SECRET_FILE_ENV = "KVTIER_TRANSPORT_SECRET_FILE"
_MIN_SECRET_BYTES = 16
# Transfer engine backends (`TransportConfig.backend`): "zmq" moves the bytes as zmq message
# frames; "mooncake" has the receiver read them with Mooncake's transfer engine (TCP or RDMA).
BACKENDS = ("zmq", "mooncake")


@dataclass(frozen=True)
class TransportConfig:
    """How one engine listens and whom it accepts.

    `namespace` is `KVIdentity.namespace`: peers with another digest are refused. `secret`,
    when set, must be proven by both sides of every connection (see `load_secret`).
    """

    namespace: bytes
    # 127.0.0.1 unless told otherwise: listening on other interfaces is the operator's choice.
    bind_host: str = "127.0.0.1"
    # 0: any free port (read it back from the engine's `address`).
    port: int = 0
    secret: bytes | None = None
    # Largest frame accepted from a peer (the largest this protocol sends), checked by zmq
    # before anything is allocated for it; a larger one disconnects the peer. It bounds each
    # frame, not a message: zmq holds a message's frames until its last one arrived.
    max_frame_bytes: int = protocol.MAX_FRAME_BYTES
    # Handshakes not finished in this time are forgotten (a peer that went quiet).
    handshake_timeout_s: float = 10.0
    # An offer whose recv is not posted within this time is failed back to its sender, which
    # then lets go of its source rather than at its own deadline (the receiver will never
    # post it: e.g. it refused the request the transfer was for), and a recv posted for it
    # later fails at once. None: an offer waits until its sender gives up.
    unclaimed_offer_timeout_s: float | None = None
    # One of BACKENDS; both ends of a transfer must use the same. "mooncake" also opens two
    # ports of Mooncake's own that listen on every interface whatever bind_host says and serve
    # registered memory, for reading and writing, without the handshake or the secret
    # (mooncake_engine.py): firewall them, or keep to "zmq" where the network is not trusted.
    backend: str = "zmq"

    def __post_init__(self) -> None:
        if len(self.namespace) != 32:
            raise ValueError(f"namespace must be the 32-byte KVIdentity.namespace digest, got "
                             f"{len(self.namespace)} bytes")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
        if self.secret is not None and len(self.secret) < _MIN_SECRET_BYTES:
            raise ValueError(f"the transport secret must be at least {_MIN_SECRET_BYTES} bytes")
        if self.max_frame_bytes < protocol.MAX_FRAME_BYTES:
            raise ValueError(f"max_frame_bytes must be >= {protocol.MAX_FRAME_BYTES} (peers "
                             f"send frames that large), got {self.max_frame_bytes}")
        if self.handshake_timeout_s <= 0:
            raise ValueError("handshake_timeout_s must be > 0")
        if self.unclaimed_offer_timeout_s is not None and not self.unclaimed_offer_timeout_s > 0:
            raise ValueError("unclaimed_offer_timeout_s must be > 0, or None to keep offers "
                             "until their sender gives up")
        if self.backend not in BACKENDS:
            raise ValueError(f"transport backend {self.backend!r} is unknown; choose one of "
                             f"{', '.join(BACKENDS)}")


def load_secret(environ: Mapping[str, str] | None = None) -> bytes | None:
    """The shared secret from $KVTIER_TRANSPORT_SECRET or the file $KVTIER_TRANSPORT_SECRET_FILE
    names (trailing newline dropped); None when neither is set."""
    env = os.environ if environ is None else environ
    value, path = env.get(SECRET_ENV), env.get(SECRET_FILE_ENV)
    if value is not None and path is not None:
        raise ValueError(f"set only one of {SECRET_ENV} and {SECRET_FILE_ENV}")
    if path is not None:
        try:
            with open(path, "rb") as f:
                secret = f.read().rstrip(b"\r\n")
        except OSError as exc:
            raise ValueError(f"cannot read {SECRET_FILE_ENV}={path!r}: {exc}") from exc
    elif value is not None:
        secret = value.encode()
    else:
        return None
    if len(secret) < _MIN_SECRET_BYTES:
        raise ValueError(f"the transport secret must be at least {_MIN_SECRET_BYTES} bytes; "
                         f"generate one with `openssl rand -hex 32`")
    return secret
