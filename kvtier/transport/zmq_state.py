"""What the zmq engine's I/O thread keeps per connection and per transfer, and the commands
callers queue for it."""

from __future__ import annotations

import queue
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field

import zmq

from kvtier.transport.base import Direction, PeerId, TransferId, TransferResult
from kvtier.transport.handshake import Dialing

COUNTERS = ("sent", "send_failed", "received", "recv_failed", "bytes_sent", "bytes_received",
            "refused_namespace", "refused_secret", "refused_protocol", "malformed",
            "late_messages", "internal_errors")


@dataclass
class Connection:
    """A connection we dialed: DEALER socket, its handshake, then the peer it reached."""

    socket: zmq.Socket
    dialing: Dialing
    deadline: float
    future: Future
    peer: PeerId | None = None
    alive: bool = True


@dataclass
class Sending:
    transfer_id: TransferId
    peer: PeerId
    views: list[memoryview]
    deadline: float
    conn: Connection | None = None
    # Set by a one-sided backend when the receiver accepted, i.e. started reading the regions.
    accepted: bool = False
    tracker: zmq.MessageTracker | None = None
    # Set when the result is known but zmq may still hold the frames.
    error: str | None = None
    ended: bool = False


@dataclass
class Receiving:
    transfer_id: TransferId
    views: list[memoryview]
    deadline: float
    # The sender's routing id once its offer was accepted.
    source: bytes | None = None


@dataclass
class Offer:
    source: bytes
    sizes: list[int]


@dataclass(frozen=True)
class Stop:
    drain_deadline: float
    hard_deadline: float


@dataclass
class State:
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    results: deque[TransferResult] = field(default_factory=deque)
    commands: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)


def make_socket(ctx: zmq.Context, kind: int, max_frame_bytes: int) -> zmq.Socket:
    socket = ctx.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    # No send limit: a full queue would block or drop accepts and dones. Queued frames are
    # headers and zero-copy views of the caller's buffers, so pending transfers bound them.
    socket.setsockopt(zmq.SNDHWM, 0)
    # zmq refuses larger frames before allocating them: a peer cannot exhaust our memory.
    socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    return socket


def direction_of(command: Sending | Receiving) -> Direction:
    return Direction.SEND if isinstance(command, Sending) else Direction.RECV


def scatter(payload: list[memoryview], views: list[memoryview]) -> None:
    """Copy the concatenation of `payload` into the concatenation of `views` (equal totals)."""
    view_index, view_offset = 0, 0
    for part in payload:
        part_offset = 0
        while part_offset < len(part):
            view = views[view_index]
            n = min(len(part) - part_offset, len(view) - view_offset)
            view[view_offset:view_offset + n] = part[part_offset:part_offset + n]
            part_offset += n
            view_offset += n
            if view_offset == len(view):
                view_index, view_offset = view_index + 1, 0
