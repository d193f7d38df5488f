"""What the zmq engine's I/O thread keeps per connection and per transfer, and the commands
callers queue for it."""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import zmq

from kvtier.transport.base import (
    Direction,
    MalformedMessageError,
    PeerId,
    TransferId,
    TransferResult,
)
from kvtier.transport.handshake import Dialing

logger = logging.getLogger(__name__)

COUNTERS = ("sent", "send_failed", "received", "recv_failed", "bytes_sent", "bytes_received",
            "refused_namespace", "refused_secret", "refused_protocol", "malformed",
            "late_messages", "replies_dropped", "internal_errors")
# Connections MalformedLog remembers having logged; the least recent is forgotten beyond.
MAX_MALFORMED_LOGGED = 1024
# At most one malformed-message warning this often; those held back are counted in the next.
MALFORMED_WARNING_INTERVAL_S = 10.0
# Replies the listener queues for one connection that dialed us, a few MiB of small messages;
# beyond it that connection's replies are dropped (see `make_listener`).
MAX_QUEUED_REPLIES = 8192


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
    # Bytes that went out with the offer; the receiver's accept asks for the rest.
    num_eager_bytes: int = 0
    accepted: bool = False
    # One per message whose frames zmq may still read from `views`.
    trackers: list[zmq.MessageTracker] = field(default_factory=list)
    # Set when the result is known but zmq may still hold the frames.
    error: str | None = None
    ended: bool = False

    @property
    def released(self) -> bool:
        """Whether zmq let go of every frame of `views` (a frame is freed only once sent or
        dropped, and a message's frames in order)."""
        return all(tracker.done for tracker in self.trackers)


@dataclass
class Receiving:
    transfer_id: TransferId
    views: list[memoryview]
    deadline: float
    # The sender's routing id once its offer was accepted.
    source: bytes | None = None
    # Bytes of the transfer written into `views` so far, in order.
    num_received: int = 0
    num_bytes: int = field(init=False)

    def __post_init__(self) -> None:
        self.num_bytes = sum(len(view) for view in self.views)


@dataclass
class Offer:
    """An offer waiting for its recv; `payload` holds the first bytes when the sender sent
    them along and the receiver had room to keep them."""

    source: bytes
    sizes: list[int]
    # The sender gives up then; the offer is forgotten.
    deadline: float
    payload: list[memoryview] = field(default_factory=list)
    # Failed back to its sender then if its recv is still not posted (see
    # `TransportConfig.unclaimed_offer_timeout_s`).
    claim_by: float = math.inf

    @property
    def num_payload_bytes(self) -> int:
        return sum(len(part) for part in self.payload)


@dataclass(frozen=True)
class Stop:
    drain_deadline: float
    hard_deadline: float


@dataclass
class State:
    """What the I/O thread and the callers share: counters, results, commands."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    # The connection to each peer we reached; written by the I/O thread only.
    peers: dict[PeerId, Connection] = field(default_factory=dict)
    commands: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    _results: deque[TransferResult] = field(default_factory=deque, init=False)
    # Signalled by the I/O thread with each result, so that a waiting caller wakes at once.
    _results_ready: threading.Condition = field(
        default_factory=lambda: threading.Condition(threading.Lock()), init=False)
    # Set by `interrupt_take`: the caller's wait ends without a result.
    _interrupted: bool = field(default=False, init=False)

    def add_result(self, result: TransferResult) -> None:
        with self._results_ready:
            self._results.append(result)
            # One waiter takes every result there is: waking one per result is enough.
            self._results_ready.notify()

    def take_results(self, timeout_s: float) -> list[TransferResult]:
        """Every result so far; when there is none, waits up to `timeout_s` for one (or for
        `interrupt_take`)."""
        with self._results_ready:
            if timeout_s > 0:
                self._results_ready.wait_for(lambda: self._results or self._interrupted,
                                             timeout_s)
            self._interrupted = False
            results = list(self._results)
            self._results.clear()
        return results

    def interrupt_take(self) -> None:
        """End the `take_results` wait under way (or the next one) at once; any thread."""
        with self._results_ready:
            self._interrupted = True
            self._results_ready.notify_all()


class MalformedLog:
    """Counts malformed messages and logs the first from each connection (its routing id, or
    the address we dialed), at most one warning per MALFORMED_WARNING_INTERVAL_S: a peer that
    opens connection after connection to send garbage fills neither our memory (the last
    MAX_MALFORMED_LOGGED connections are remembered) nor our logs."""

    def __init__(self, counts: dict[str, int],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._counts, self._clock = counts, clock
        self._logged: OrderedDict[bytes, None] = OrderedDict()
        self._next_warning = 0.0
        self._num_held_back = 0

    def __len__(self) -> int:
        return len(self._logged)

    def record(self, source: bytes, exc: MalformedMessageError) -> None:
        self._counts["malformed"] += 1
        if source in self._logged:
            self._logged.move_to_end(source)
            return
        self._logged[source] = None
        if len(self._logged) > MAX_MALFORMED_LOGGED:
            self._logged.popitem(last=False)
        now = self._clock()
        if now < self._next_warning:
            self._num_held_back += 1
            return
        held_back = (f" ({self._num_held_back} more connections sent malformed messages since "
                     f"the last warning)" if self._num_held_back else "")
        logger.warning("transport: dropped a malformed message from a peer: %s%s", exc,
                       held_back)
        self._next_warning, self._num_held_back = now + MALFORMED_WARNING_INTERVAL_S, 0


def make_socket(ctx: zmq.Context, kind: int, max_frame_bytes: int) -> zmq.Socket:
    """A socket with the engine's options (the listener adds its own: `make_listener`)."""
    socket = ctx.socket(kind)
    socket.setsockopt(zmq.LINGER, 0)
    # No send limit: a full queue would block or drop our offers and data. Queued frames are
    # headers and zero-copy views of the caller's buffers, so pending transfers bound them.
    socket.setsockopt(zmq.SNDHWM, 0)
    # zmq refuses a larger frame before allocating it and drops the peer. Per frame only: it
    # buffers a message's frames until the last, which no zmq option bounds.
    socket.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
    return socket


def make_listener(ctx: zmq.Context, max_frame_bytes: int) -> zmq.Socket:
    """The ROUTER peers dial. It sends only replies (`IOLoop._reply`), never payload: one for
    each handshake message, and accepts, dones and fails, a few per transfer at most."""
    socket = make_socket(ctx, zmq.ROUTER, max_frame_bytes)
    # A peer's I/O thread reads its replies as they come, so only one that stopped reading
    # (or never meant to) gets near this many; the rest of its replies are dropped and
    # counted rather than held in our memory. A dropped accept or done fails its transfer at
    # the deadline, on both sides; it never corrupts one.
    socket.setsockopt(zmq.SNDHWM, MAX_QUEUED_REPLIES)
    # A full queue (or a peer that is gone) makes the send raise EAGAIN (EHOSTUNREACH) rather
    # than drop the reply silently: `IOLoop._reply` counts it.
    socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
    return socket


def direction_of(command: Sending | Receiving) -> Direction:
    return Direction.SEND if isinstance(command, Sending) else Direction.RECV


def cut(views: list[memoryview], start: int, stop: int) -> list[memoryview]:
    """Bytes `start:stop` of the concatenation of `views`, as slices of them (no copy)."""
    parts, view_start = [], 0
    for view in views:
        view_stop = view_start + len(view)
        if view_stop > start and view_start < stop:
            parts.append(view[max(start - view_start, 0):min(stop, view_stop) - view_start])
        view_start = view_stop
    return parts


def scatter(payload: list[memoryview], views: list[memoryview], offset: int = 0) -> None:
    """Copy the concatenation of `payload` into the concatenation of `views`, starting
    `offset` bytes into it (the payload must fit)."""
    view_index, view_offset = 0, offset
    while view_index < len(views) and view_offset >= len(views[view_index]):
        view_offset -= len(views[view_index])
        view_index += 1
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
