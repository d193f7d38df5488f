"""Moving KV bytes between processes and machines: the `TransferEngine` interface, its default
zmq backend, and the handshake that refuses peers whose KV is not interchangeable with ours.

Torch-free: engines move registered memoryviews. zmq is imported only with the zmq backend.
"""

from kvtier.transport.base import (
    AuthenticationError,
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
from kvtier.transport.config import TransportConfig, load_secret

__all__ = [
    "AuthenticationError", "BufferId", "Direction", "HandshakeError", "MalformedMessageError",
    "NamespaceMismatchError", "PeerId", "Region", "TransferEngine", "TransferId",
    "TransferResult", "TransportConfig", "TransportError", "load_secret",
]
