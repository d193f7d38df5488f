"""The zmq engine's I/O thread: it alone owns the sockets, the handshakes and the transfers
(both ends of a transfer: `zmq_transfer.py`).

Sockets: one ROUTER bound at the engine's address takes every connection peers dialed to us
(handshakes, offers and data frames arrive there); one DEALER per peer we dialed carries our
offers and data frames out and that peer's accepts, dones and fails back.

A zero-copy payload frame is read by zmq's own I/O thread after `send` returns, so a send is
reported finished only when the MessageTrackers of all its messages say zmq let go of the
memory. A send past its deadline whose frames are still queued closes its connection (linger
0), which makes zmq drop them; the send (and every other on that connection) is reported
failed once released.
"""

from __future__ import annotations

import logging
import queue
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future

import zmq

from kvtier.transport import protocol
from kvtier.transport.base import (
    Direction,
    MalformedMessageError,
    PeerId,
    TransferId,
    TransferResult,
)
from kvtier.transport.config import TransportConfig
from kvtier.transport.handshake import Accepting, Dialing, LocalIdentity, Refusal, RefusalLog
from kvtier.transport.zmq_state import (
    Connection,
    MalformedLog,
    Offer,
    Receiving,
    Sending,
    State,
    Stop,
    direction_of,
    make_socket,
)
from kvtier.transport.zmq_transfer import ReceiverSide, SenderSide

logger = logging.getLogger(__name__)

# Unfinished handshakes kept; a new one beyond this forgets the oldest.
MAX_HANDSHAKES = 1024
# Welcomed connections kept; beyond this the least recently active must handshake again.
MAX_WELCOMED = 1024
# Deadlines are checked this often at most: a transfer fails at most this late.
_EXPIRY_INTERVAL_S = 0.01
_IDLE_POLL_MS = 200
# A send the receiver confirmed waits for zmq to free its frames, which no socket announces.
_RELEASE_POLL_MS = 1
# Lets a refusal or fail we send reach the peer before our side of the connection goes.
_REFUSAL_LINGER_MS = 200


class IOLoop(SenderSide, ReceiverSide):
    """Runs in one thread (`run`); talks to the caller through `state` and `wake`."""
    TRANSFER_KINDS = ("offer", "data", "fail")  # from a welcomed peer, each to its `_on_<kind>`

    def __init__(self, ctx: zmq.Context, listener: zmq.Socket, wake: zmq.Socket,
                 local: LocalIdentity, state: State, config: TransportConfig,
                 on_result: Callable[[TransferResult], None]) -> None:
        self.ctx, self.listener, self.wake, self.local = ctx, listener, wake, local
        self.state, self.counts = state, state.counts
        self.handshake_timeout_s = config.handshake_timeout_s
        self.max_frame_bytes = config.max_frame_bytes
        self.unclaimed_offer_timeout_s = config.unclaimed_offer_timeout_s
        self.on_result = on_result
        self.refusals = RefusalLog(self.counts)
        self.poller = zmq.Poller()
        self.poller.register(listener, zmq.POLLIN)
        self.poller.register(wake, zmq.POLLIN)
        # Routing id -> its unfinished handshake, oldest first.
        self.accepting: OrderedDict[bytes, Accepting] = OrderedDict()
        # Routing id -> the peer it authenticated as, least recently active first.
        self.welcomed: OrderedDict[bytes, PeerId] = OrderedDict()
        self.conns: dict[zmq.Socket, Connection] = {}
        self.peers = state.peers
        self.sends: dict[TransferId, Sending] = {}
        self.releasing: list[Sending] = []
        self.recvs: dict[TransferId, Receiving] = {}
        self.offers: dict[TransferId, Offer] = {}
        self.unclaimed: OrderedDict[TransferId, None] = OrderedDict()
        self.num_kept_bytes = 0
        self.malformed_logged = MalformedLog(self.counts)
        self.stop: Stop | None = None
        self._next_expiry = 0.0

    # ---- main loop -------------------------------------------------------------------------

    def run(self) -> None:
        try:
            while not self._finished():
                timeout = (_IDLE_POLL_MS if self._idle() else _RELEASE_POLL_MS if self.releasing
                           else int(_EXPIRY_INTERVAL_S * 1000))
                for socket, _ in self.poller.poll(timeout):
                    self._drain(socket)
                now = time.monotonic()
                if now >= self._next_expiry:
                    self._expire(now)
                    self._next_expiry = now + _EXPIRY_INTERVAL_S
                self._release()
        finally:
            self._close_all()

    def _idle(self) -> bool:
        return not (self.sends or self.recvs or self.releasing or self.stop or self.accepting
                    or any(c.peer is None for c in self.conns.values()))

    def _finished(self) -> bool:
        if self.stop is None:
            return False
        now = time.monotonic()
        if now >= self.stop.drain_deadline and (self.sends or self.recvs):
            self._fail_everything("engine shut down with the transfer in flight")
        if now >= self.stop.hard_deadline:
            for sending in self.releasing:
                # Sockets are closed (linger 0): zmq will only free these frames, never send them.
                self._report(sending.transfer_id, Direction.SEND, sending.error)
            self.releasing.clear()
        return not (self.sends or self.recvs or self.releasing)

    def _drain(self, socket: zmq.Socket) -> None:
        # At most 256 messages per socket per pass, so one busy peer cannot hold off the
        # others or the deadlines.
        for _ in range(256):
            if socket.closed:
                return  # closed while handling an earlier message
            try:
                frames = socket.recv_multipart(flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._handle(socket, frames)
            except Exception:
                # A bug costs one message, never this thread, which every transfer waits on.
                self.counts["internal_errors"] += 1
                logger.exception("transport: failed to handle a message; dropped it")

    def _handle(self, socket: zmq.Socket, frames: list[zmq.Frame]) -> None:
        if socket is self.wake:
            self._run_commands()
        elif socket is self.listener:
            self._on_incoming(frames[0].bytes, frames[1:])
        else:
            self._on_dialed(self.conns[socket], frames)

    # ---- commands from the caller ------------------------------------------------------------

    def _run_commands(self) -> None:
        while True:
            try:
                command = self.state.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, Stop):
                self.stop = command
                for tid in list(self.offers):  # no recv will take them: senders need not wait
                    self._fail_to(self._pop_offer(tid).source, tid, "the receiver shut down")
            elif self.stop is not None and not isinstance(command, tuple):
                self._report(command.transfer_id, direction_of(command), "engine is shutting down")
            elif isinstance(command, tuple):
                self._dial(*command)
            elif isinstance(command, Sending):
                self._start_send(command)
            else:
                self._start_recv(command)

    def _dial(self, address: str, deadline: float, future: Future) -> None:
        if self.stop is not None:
            future.set_exception(ConnectionError("engine is shutting down"))
            return
        socket = make_socket(self.ctx, zmq.DEALER, self.max_frame_bytes)
        conn = Connection(socket, Dialing(self.local, address), deadline, future)
        try:
            socket.connect(address)
        except zmq.ZMQError as exc:
            socket.close(linger=0)
            future.set_exception(ConnectionError(f"cannot connect to {address!r}: {exc}"))
            return
        self.conns[socket] = conn
        self.poller.register(socket, zmq.POLLIN)
        self._send(conn, [conn.dialing.hello()])

    def _start_send(self, sending: Sending) -> None:
        conn = self.peers.get(sending.peer)
        if conn is None:
            self._report(sending.transfer_id, Direction.SEND,
                         f"not connected to peer {sending.peer} (connect again)")
            return
        sending.conn = conn
        self.sends[sending.transfer_id] = sending
        self._send_offer(sending)

    # ---- the connection peers dialed to us (receiving side) ----------------------------------

    def _on_incoming(self, source: bytes, frames: list[zmq.Frame]) -> None:
        try:
            msg = protocol.decode(frames[0].buffer) if frames else None
            if msg is None:
                raise MalformedMessageError("empty message")
        except MalformedMessageError as exc:
            self._malformed(source, exc)
            return
        kind, accepting, welcomed = msg["t"], self.accepting.get(source), source in self.welcomed
        if kind in self.TRANSFER_KINDS and welcomed:
            self.welcomed.move_to_end(source)
            getattr(self, f"_on_{kind}")(source, msg, frames[1:])
        elif kind == "hello" and not welcomed:
            self._on_hello(source, msg)
        elif kind == "proof" and accepting is not None:
            self._reply_handshake(source, accepting, accepting.on_proof(msg))
        elif kind == "refused" and accepting is not None:
            code = msg["code"] if msg["code"] in protocol.REFUSAL_CODES else "protocol"
            self.refusals.record(Refusal(code, f"it refused us: {msg['reason']}"),
                                 accepting.peer or "?")
            del self.accepting[source]
        elif kind in (*self.TRANSFER_KINDS, "proof"):
            self.counts["refused_protocol"] += 1
            self._reply(source, protocol.encode("refused", code=protocol.REFUSED_PROTOCOL,
                                                reason="handshake first"))
        else:
            self._malformed(source, MalformedMessageError(f"unexpected {kind!r}"))

    def _on_hello(self, source: bytes, msg: dict) -> None:
        self.accepting.pop(source, None)  # a hello again starts over
        if len(self.accepting) >= MAX_HANDSHAKES:
            self.accepting.popitem(last=False)  # only the oldest: others' handshakes go on
        accepting = Accepting(self.local, time.monotonic())
        self.accepting[source] = accepting
        self._reply_handshake(source, accepting, accepting.on_hello(msg))

    def _reply_handshake(self, source: bytes, accepting: Accepting, reply) -> None:
        frame, refusal = reply
        if refusal is not None:  # counted before the peer can hear of it
            self.refusals.record(refusal, accepting.peer or "?")
            del self.accepting[source]
        elif accepting.welcomed:
            del self.accepting[source]
            self._welcome(source, accepting.peer)
        self._reply(source, frame)

    def _welcome(self, source: bytes, peer: PeerId) -> None:
        """Remember a connection that passed the handshake: one per peer, whose new connection
        replaces its old (the dialer closes that, failing every send on it), and at most
        MAX_WELCOMED."""
        for old in [s for s, p in self.welcomed.items() if p == peer]:
            del self.welcomed[old]
            self._forget_source(old)
        self.welcomed[source] = peer
        if len(self.welcomed) > MAX_WELCOMED:
            self.welcomed.popitem(last=False)

    def _reply(self, source: bytes, frame: bytes) -> None:
        # Never blocks this thread: a peer that is gone, or that has MAX_QUEUED_REPLIES unread,
        # loses the reply (see `make_listener`).
        try:
            self.listener.send_multipart([source, frame], flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self.counts["replies_dropped"] += 1

    def _malformed(self, source: bytes, exc: MalformedMessageError) -> None:
        self.malformed_logged.record(source, exc)

    # ---- connections we dialed (sending side) ------------------------------------------------

    def _on_dialed(self, conn: Connection, frames: list[zmq.Frame]) -> None:
        try:
            msg = protocol.decode(frames[0].buffer)
        except MalformedMessageError as exc:
            self._malformed(conn.dialing.address.encode(), exc)
            return
        kind = msg["t"]
        if kind == "refused":
            self._on_refused(conn, msg)
        elif conn.peer is None:
            self._on_dialing(conn, msg)
        elif kind in ("accept", "done", "fail"):
            sending = self.sends.get(TransferId(msg["id"]))
            if sending is None or sending.conn is not conn or sending.ended:
                self.counts["late_messages"] += 1
            elif kind == "accept" and not sending.accepted:
                sending.accepted = True
                self._on_accept(sending, msg["offset"])
            elif kind != "accept":
                self._end_send(sending, msg["error"] if kind == "fail" else None)
        else:
            self._malformed(conn.dialing.address.encode(), MalformedMessageError(kind))

    def _on_dialing(self, conn: Connection, msg: dict) -> None:
        if msg["t"] == "hello_ack" and conn.dialing.peer is None:
            frame, refusal = conn.dialing.on_hello_ack(msg)
            self._send(conn, [frame])
            if refusal is not None:
                self.refusals.record(refusal, conn.dialing.address)
                self._close(conn, refusal.error(), linger_ms=_REFUSAL_LINGER_MS)
        elif msg["t"] == "welcome" and conn.dialing.peer is not None:
            conn.peer = conn.dialing.peer
            old = self.peers.get(conn.peer)
            if old is not None and old.alive:
                self._close(old, None)
            self.peers[conn.peer] = conn
            conn.future.set_result(conn.peer)
        else:
            self._malformed(conn.dialing.address.encode(),
                            MalformedMessageError(f"unexpected {msg['t']!r} in handshake"))

    def _on_refused(self, conn: Connection, msg: dict) -> None:
        code = msg["code"] if msg["code"] in protocol.REFUSAL_CODES else protocol.REFUSED_PROTOCOL
        refusal = Refusal(code, f"{conn.dialing.address} refused us: {msg['reason']}")
        self.refusals.record(refusal, conn.dialing.address)
        self._close(conn, refusal.error())

    def _send(self, conn: Connection, frames: list, track: bool = False):
        """Send on a dialed connection without ever blocking this thread: a peer that does not
        read (queue full) loses its connection, which fails its transfers."""
        try:
            return conn.socket.send_multipart(frames, flags=zmq.NOBLOCK, copy=not track,
                                              track=track)
        except zmq.ZMQError as exc:
            self._close(conn, ConnectionError(f"cannot send to {conn.dialing.address}: {exc}"))
            return None

    def _end_send(self, sending: Sending, error: str | None) -> None:
        sending.ended, sending.error = True, error
        del self.sends[sending.transfer_id]
        self.releasing.append(sending)

    def _release(self) -> None:
        """Report the sends whose frames zmq let go of."""
        if not self.releasing:
            return
        waiting = []
        for sending in self.releasing:
            if sending.released:
                if sending.error is None:
                    self.counts["bytes_sent"] += sum(len(v) for v in sending.views)
                self._report(sending.transfer_id, Direction.SEND, sending.error)
            else:
                waiting.append(sending)
        self.releasing = waiting

    # ---- deadlines, closing ------------------------------------------------------------------

    def _expire(self, now: float) -> None:
        for sending in [s for s in self.sends.values() if now >= s.deadline]:
            if sending.transfer_id not in self.sends:
                continue  # ended by the close of its connection just before
            if not sending.released:
                self._close(sending.conn, None)  # the only way to make zmq drop queued frames
            else:
                self._fail_send(sending, "deadline passed before the receiver confirmed")
        for sending in [s for s in self.releasing if now >= s.deadline and not s.released]:
            self._close(sending.conn, None)  # ended (e.g. failed by its receiver), frames stuck
        for receiving in [r for r in self.recvs.values() if now >= r.deadline]:
            if receiving.source is not None:
                self._fail_to(receiving.source, receiving.transfer_id, "receiver deadline passed")
            self._end_recv(receiving, "deadline passed before the data arrived")
        for tid in [tid for tid, offer in self.offers.items() if now >= offer.deadline]:
            self._pop_offer(tid)  # its sender gave up (and may be gone)
        for tid in [tid for tid, offer in self.offers.items() if now >= offer.claim_by]:
            self._fail_unclaimed(tid)
        for conn in [c for c in self.conns.values() if c.peer is None and now >= c.deadline]:
            self._close(conn, TimeoutError(f"no handshake with {conn.dialing.address} in time"))
        self._forget_stale_handshakes(now)

    def _forget_stale_handshakes(self, now: float) -> None:
        limit = now - self.handshake_timeout_s
        while self.accepting and next(iter(self.accepting.values())).started <= limit:
            self.accepting.popitem(last=False)  # oldest first: they are kept in start order

    def _close(self, conn: Connection, error: Exception | None, linger_ms: int = 0) -> None:
        """Close a dialed connection; its unfinished sends fail once zmq released them."""
        if not conn.alive:
            return
        conn.alive = False
        self.poller.unregister(conn.socket)
        conn.socket.close(linger=linger_ms)
        del self.conns[conn.socket]
        if not conn.future.done():
            conn.future.set_exception(error or ConnectionError("connection closed"))
        if conn.peer is not None and self.peers.get(conn.peer) is conn:
            del self.peers[conn.peer]
        for sending in [s for s in self.sends.values() if s.conn is conn]:
            self._end_send(sending, "connection to the peer closed (deadline or refusal)")

    def _fail_everything(self, error: str) -> None:
        for conn in list(self.conns.values()):
            self._close(conn, ConnectionError(error))
        for receiving in list(self.recvs.values()):
            if receiving.source is not None:
                self._fail_to(receiving.source, receiving.transfer_id, error)
            self._end_recv(receiving, error)

    def _close_all(self) -> None:
        for conn in list(self.conns.values()):
            self._close(conn, ConnectionError("engine shut down"))
        # Lets the fails of the offers that waited at the stop reach their senders.
        self.listener.close(linger=_REFUSAL_LINGER_MS)
        self.wake.close(linger=0)

    def _report(self, tid: TransferId, direction: Direction, error: str | None) -> None:
        ok_key, failed_key = (("sent", "send_failed") if direction is Direction.SEND
                              else ("received", "recv_failed"))
        self.counts[ok_key if error is None else failed_key] += 1
        result = TransferResult(tid, direction, error)
        self.on_result(result)
        self.state.add_result(result)
