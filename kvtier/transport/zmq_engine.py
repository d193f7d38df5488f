"""The default transfer engine: pyzmq over TCP, zero-copy sends, a msgpack-framed protocol.

Calls from any thread only check their arguments and queue a command; one I/O thread
(`zmq_loop.IOLoop`) owns every socket. Works across machines: bind `TransportConfig.bind_host`
to an interface peers can reach (127.0.0.1 by default) and give them `address`.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future

import zmq

from kvtier.transport import protocol
from kvtier.transport.base import (
    BufferId,
    Direction,
    PeerId,
    Region,
    TransferEngine,
    TransferId,
    TransferResult,
    TransportError,
)
from kvtier.transport.config import TransportConfig
from kvtier.transport.handshake import LocalIdentity
from kvtier.transport.zmq_loop import IOLoop
from kvtier.transport.zmq_state import (
    Receiving,
    Sending,
    State,
    Stop,
    make_listener,
    make_socket,
)

MAX_ID_CHARS = 1024


class ZmqTransferEngine(TransferEngine):
    """See `TransferEngine`; one ROUTER listener, one DEALER per dialed peer, one I/O thread."""

    def __init__(self, config: TransportConfig, engine_id: str | None = None) -> None:
        self.config = config
        self._engine_id = PeerId(engine_id or uuid.uuid4().hex)
        self._ctx = zmq.Context(io_threads=1)
        listener = make_listener(self._ctx, config.max_frame_bytes)
        try:
            listener.bind(f"tcp://{config.bind_host}:{config.port}")
        except zmq.ZMQError as exc:
            listener.close(linger=0)
            self._ctx.term()
            raise TransportError(f"cannot listen on {config.bind_host}:{config.port}: {exc} "
                                 f"(choose another port, or 0 for any free one)") from exc
        self._address = listener.getsockopt_string(zmq.LAST_ENDPOINT)
        wake_url = f"inproc://kvtier-transport-{self._engine_id}"
        wake_rx, self._wake = self._socket(zmq.PAIR), self._socket(zmq.PAIR)
        wake_rx.bind(wake_url)
        self._wake.connect(wake_url)
        self._lock = threading.Lock()
        self._buffers: dict[BufferId, memoryview] = {}
        self._buffer_users: Counter[BufferId] = Counter()
        self._active: dict[tuple[Direction, TransferId], list[BufferId]] = {}
        self._state = State()
        self._closed = False
        local = LocalIdentity(self._engine_id, config.namespace.hex(), config.secret)
        loop = self._make_loop(listener, wake_rx, local)
        self._thread = threading.Thread(target=loop.run, name="kvtier-transport", daemon=True)
        self._thread.start()

    def _make_loop(self, listener: zmq.Socket, wake: zmq.Socket, local: LocalIdentity) -> IOLoop:
        """The I/O thread's loop; a backend that moves the bytes another way extends it."""
        return IOLoop(self._ctx, listener, wake, local, self._state, self.config,
                      self._on_result)

    def _socket(self, kind: int) -> zmq.Socket:
        return make_socket(self._ctx, kind, self.config.max_frame_bytes)

    @property
    def address(self) -> str:
        return self._address

    @property
    def engine_id(self) -> PeerId:
        return self._engine_id

    # ---- buffers -------------------------------------------------------------------------------

    def register_buffer(self, buffer_id: BufferId, buffer: memoryview) -> None:
        view = memoryview(buffer)
        if not view.c_contiguous:
            raise TransportError(f"buffer {buffer_id!r} must be C-contiguous")
        with self._lock:
            if buffer_id in self._buffers:
                raise TransportError(f"buffer {buffer_id!r} is already registered")
            self._buffers[buffer_id] = view.cast("B")

    def unregister_buffer(self, buffer_id: BufferId) -> None:
        with self._lock:
            if self._buffer_users[buffer_id]:
                raise TransportError(f"buffer {buffer_id!r} is used by "
                                     f"{self._buffer_users[buffer_id]} pending transfers")
            if self._buffers.pop(buffer_id, None) is None:
                raise TransportError(f"buffer {buffer_id!r} is not registered")

    def _views(self, regions: Sequence[Region], writable: bool) -> list[memoryview]:
        if not 0 < len(regions) <= protocol.MAX_REGIONS:
            raise TransportError(f"a transfer needs 1 to {protocol.MAX_REGIONS} regions, got "
                                 f"{len(regions)} (merge adjacent ones)")
        views = []
        for region in regions:
            buffer = self._buffers.get(region.buffer_id)
            if buffer is None:
                raise TransportError(f"buffer {region.buffer_id!r} is not registered")
            if region.offset < 0 or region.length <= 0 \
                    or region.offset + region.length > len(buffer):
                raise TransportError(f"{region} is outside buffer {region.buffer_id!r} of "
                                     f"{len(buffer)} bytes")
            if writable and buffer.readonly:
                raise TransportError(f"buffer {region.buffer_id!r} is read-only")
            views.append(buffer[region.offset:region.offset + region.length])
        return views

    # ---- operations ----------------------------------------------------------------------------

    def connect_async(self, address: str, timeout_s: float) -> Future[PeerId]:
        future: Future = Future()
        self._submit((address, self._deadline(timeout_s), future))
        return future

    def is_connected(self, peer: PeerId) -> bool:
        return peer in self._state.peers

    def send(self, peer: PeerId, transfer_id: TransferId, regions: Sequence[Region],
             timeout_s: float) -> None:
        deadline = self._deadline(timeout_s)
        with self._lock:
            views = self._views(regions, writable=False)
            self._claim(Direction.SEND, transfer_id, regions)
        self._submit(Sending(transfer_id, peer, views, deadline))

    def recv(self, transfer_id: TransferId, regions: Sequence[Region], timeout_s: float) -> None:
        deadline = self._deadline(timeout_s)
        with self._lock:
            views = self._views(regions, writable=True)
            self._claim(Direction.RECV, transfer_id, regions)
        self._submit(Receiving(transfer_id, views, deadline))

    def _claim(self, direction: Direction, transfer_id: TransferId,
               regions: Sequence[Region]) -> None:
        key = (direction, transfer_id)
        if not isinstance(transfer_id, str) or not 0 < len(transfer_id) <= MAX_ID_CHARS:
            raise TransportError(f"a transfer id is a string of 1 to {MAX_ID_CHARS} "
                                 f"characters, got {transfer_id!r:.80}")
        if key in self._active:
            raise TransportError(f"{direction.value} {transfer_id!r} is already pending")
        self._active[key] = [region.buffer_id for region in regions]
        self._buffer_users.update(self._active[key])

    def _on_result(self, result: TransferResult) -> None:
        """Called by the I/O thread when the engine lets go of a transfer's regions."""
        with self._lock:
            buffers = self._active.pop((result.direction, result.transfer_id), [])
            self._buffer_users.subtract(buffers)

    def _deadline(self, timeout_s: float) -> float:
        if self._closed:
            raise TransportError("the transfer engine is shut down")
        if not timeout_s > 0:
            raise TransportError(f"timeout_s must be > 0, got {timeout_s}")
        return time.monotonic() + timeout_s

    def _submit(self, command: object) -> None:
        self._state.commands.put(command)
        self._wake_loop(stopping=isinstance(command, Stop))

    def _wake_loop(self, stopping: bool = False) -> None:
        """Make the I/O thread look at its commands (and a backend's news) now."""
        with self._lock:
            # Once closed, only the Stop wakes it: the wake socket goes when the thread ends.
            if self._closed and not stopping:
                return
            try:
                self._wake.send(b"", flags=zmq.NOBLOCK)
            except zmq.Again:
                pass  # the loop has wake-ups queued already; it reads every command on each

    def get_finished(self, timeout_s: float = 0.0) -> list[TransferResult]:
        return self._state.take_results(timeout_s)

    def interrupt_get_finished(self) -> None:
        self._state.interrupt_take()

    def stats(self) -> dict[str, int]:
        return dict(self._state.counts)

    def shutdown(self, timeout_s: float) -> None:
        if self._closed:
            return
        start = time.monotonic()
        self._submit(Stop(drain_deadline=start + 0.7 * timeout_s,
                          hard_deadline=start + 0.9 * timeout_s))
        with self._lock:
            self._closed = True
        self._thread.join(max(0.0, start + timeout_s - time.monotonic()))
        if not self._thread.is_alive():
            self._wake.close(linger=0)
            # Every socket is closed with linger 0 (or the short linger of a refusal), so the
            # context ends promptly; a daemon thread keeps even that off the caller's deadline.
            threading.Thread(target=self._ctx.term, name="kvtier-transport-term",
                             daemon=True).start()
