"""The transfer engine contract: move bytes between registered host buffers of two processes.

A transfer is one id, a list of regions on the sending side and a list of regions of the same
sizes on the receiving side (scatter-gather: a request's blocks need not be contiguous). Both
sides name the transfer by the same `TransferId`; the receiver never needs to know the sender.

    receiver                                    sender
    register_buffer("kv", view)                 register_buffer("kv", view)
                                                peer = connect(receiver.address, timeout_s)
    recv(tid, [Region("kv", 0, n)], timeout_s)  send(peer, tid, [Region("kv", 4096, n)], timeout_s)
    ... get_finished() -> [TransferResult(tid, RECV, error=None)]   ... (tid, SEND, None)

Every call but `connect` returns at once (`connect_async` is its non-blocking form);
completions (success or failure) come from `get_finished()`, each transfer exactly once.
`get_finished(timeout_s)` waits up to `timeout_s` for a completion when none is there yet, and
returns as soon as one is (empty at its deadline): a caller that has nothing else to do waits
for its transfer without polling.

Every transfer has a deadline: one not complete by then is reported failed, on both sides.
Until a transfer's result is reported its regions belong to the engine: the sender must not
reuse its source memory (the engine may still read it) and the receiver must not read its
destination. After the result is reported the engine never touches them again, whatever the
peer does later.

Before any KV moves, `connect` runs a handshake: both sides show the digest of their
`KVIdentity` (KV bytes are only interchangeable between equal digests) and, with a shared secret,
prove they know it. A refused peer raises a `HandshakeError` subclass.

Adding a backend: the protocol is offer / accept / move / acknowledge. The sender *offers* a
transfer (id, region sizes); the receiver, once it has posted `recv` for that id, *accepts*;
the bytes move; the receiver *acknowledges* once it holds every byte. The zmq backend
(`zmq_engine.py`, `zmq_transfer.py`) sends a transfer's first bytes with the offer (a small
transfer needs no accept) and the rest after the accept as several data messages, which the
receiver copies in as they come. A one-sided RDMA backend keeps the same calls and messages:

* NIXL: `register_buffer` registers the memory with the agent (`register_memory`) and the offer
  carries the sender's serialized descriptors; the receiver READs them into its own registered
  regions (`make_prepped_xfer` / `transfer`) when `recv` is posted, polls `check_xfer_state`
  and acknowledges with a notification. The handshake also exchanges the agents' metadata.
* Mooncake (`mooncake_engine.py`): `register_buffer` also calls `register_memory`; the offer
  (`pull`) carries the sender's session id and region addresses; the receiver reads them with
  `batch_transfer_async_read`, polls `transfer_check_status` and acknowledges over the zmq
  control connection. It cannot cancel a read, so the sender keeps its source regions until
  the receiver's done or fail (or a grace past its deadline).

Either way the deadlines, the handshake and `get_finished` stay as they are; only the way bytes
cross changes, so the tests in tests/transport run unchanged against every backend.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import NewType

# Names a transfer on both sides; unique among the receiver's pending transfers (a second
# offer of an id the receiver is already receiving fails).
TransferId = NewType("TransferId", str)
# Names a registered buffer inside one engine.
BufferId = NewType("BufferId", str)
# The remote engine's id, learnt in the handshake.
PeerId = NewType("PeerId", str)
# connect() waits this much past its own deadline for the engine's verdict, which is final.
_CONNECT_GRACE_S = 1.0


class TransportError(Exception):
    """A transfer engine could not do what it was asked (bad region, closed engine)."""


class BackendUnavailableError(TransportError):
    """The chosen transport backend cannot run here (its package is not installed)."""


class HandshakeError(TransportError):
    """A peer was refused before any KV moved."""


class NamespaceMismatchError(HandshakeError):
    """The peer computes KV that is not interchangeable with ours (another KVIdentity)."""


class AuthenticationError(HandshakeError):
    """The peer did not prove the shared secret (wrong secret, or only one side has one)."""


class MalformedMessageError(TransportError):
    """Bytes from a peer that are not a message of this protocol; they are dropped unread."""


class Direction(enum.Enum):
    SEND = "send"
    RECV = "recv"


@dataclass(frozen=True)
class Region:
    """`length` bytes at `offset` of the registered buffer `buffer_id`."""

    buffer_id: BufferId
    offset: int
    length: int


@dataclass(frozen=True)
class TransferResult:
    """A finished transfer; `error` is None on success, else why it failed."""

    transfer_id: TransferId
    direction: Direction
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None


class TransferEngine(ABC):
    """Moves registered host memory to and from peer engines; see the module docstring."""

    @property
    @abstractmethod
    def address(self) -> str:
        """Where peers `connect` to reach this engine (e.g. "tcp://10.0.0.5:41234")."""

    @property
    @abstractmethod
    def engine_id(self) -> PeerId:
        """This engine's id, as its peers see it."""

    @abstractmethod
    def register_buffer(self, buffer_id: BufferId, buffer: memoryview) -> None:
        """Make `buffer` (writable, C-contiguous) usable in regions named `buffer_id`."""

    @abstractmethod
    def unregister_buffer(self, buffer_id: BufferId) -> None:
        """Forget a buffer; raises TransportError while a pending transfer uses it."""

    def connect(self, address: str, timeout_s: float) -> PeerId:
        """Reach the engine at `address` and run the handshake; blocks at most `timeout_s`.

        Raises NamespaceMismatchError / AuthenticationError when refused, TimeoutError when
        the peer does not answer in time."""
        return self.connect_async(address, timeout_s).result(timeout=timeout_s + _CONNECT_GRACE_S)

    @abstractmethod
    def connect_async(self, address: str, timeout_s: float) -> Future[PeerId]:
        """`connect` without blocking: the future ends with the peer id or `connect`'s error
        within `timeout_s`, set from the engine's own thread (keep its callbacks short)."""

    @abstractmethod
    def is_connected(self, peer: PeerId) -> bool:
        """Whether the connection to `peer` is up: a send to a peer whose connection closed
        (deadline, refusal, the peer restarted) fails until it is connected again."""

    @abstractmethod
    def send(self, peer: PeerId, transfer_id: TransferId, regions: Sequence[Region],
             timeout_s: float) -> None:
        """Start sending `regions` (concatenated) as `transfer_id`; completes via get_finished."""

    @abstractmethod
    def recv(self, transfer_id: TransferId, regions: Sequence[Region], timeout_s: float) -> None:
        """Start receiving `transfer_id` into `regions`; completes via get_finished."""

    @abstractmethod
    def get_finished(self, timeout_s: float = 0.0) -> list[TransferResult]:
        """Transfers finished since the last call. When there are none, waits up to
        `timeout_s` for one and returns as soon as it is reported (or on
        `interrupt_get_finished`); 0 never blocks."""

    @abstractmethod
    def interrupt_get_finished(self) -> None:
        """End the `get_finished` wait under way (or the next one) at once, with whatever has
        finished; safe from any thread."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters: transfers done and failed, bytes moved, peers refused and why."""

    @abstractmethod
    def shutdown(self, timeout_s: float) -> None:
        """Stop; returns within `timeout_s`. Pending transfers are reported failed."""
