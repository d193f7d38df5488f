"""Moving KV bytes between processes and machines: the `TransferEngine` interface, its default
zmq backend, a Mooncake backend, and the handshake that refuses peers whose KV is not
interchangeable with ours.

Torch-free: engines move registered memoryviews. zmq and Mooncake are imported only when
`make_transfer_engine` builds an engine of that backend.
"""

from kvtier.transport.base import (
    AuthenticationError,
    BackendUnavailableError,
    BufferId,
    Direction,
    HandshakeError,
    MalformedMessageError,
    NamespaceMismatchError,
    PeerId,
    Region,
    TransferEngine,
    TransferId,
    TransferResult,
    TransportError,
)
from kvtier.transport.config import BACKENDS, TransportConfig, load_secret
from kvtier.transport.registry import make_transfer_engine

__all__ = [
    "AuthenticationError", "BACKENDS", "BackendUnavailableError", "BufferId", "Direction",
    "HandshakeError", "MalformedMessageError", "NamespaceMismatchError", "PeerId", "Region",
    "TransferEngine", "TransferId", "TransferResult", "TransportConfig", "TransportError",
    "load_secret", "make_transfer_engine",
]
