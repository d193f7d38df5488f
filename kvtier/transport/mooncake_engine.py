"""The Mooncake backend: the zmq engine's control path, with the bytes pulled by Mooncake's
transfer engine (its TCP transport; RDMA where Mooncake finds devices).

    sender                                  receiver
    (zmq handshake, as the zmq backend)
    pull {id, sizes, session, addrs, ttl}  ->        waits until recv(id) is posted
                                           <-  accept {id, 0}  and reads the regions with Mooncake
                                           <-  done {id}     (or fail {id, error})

`register_buffer` also registers the memory with Mooncake. The sender offers its regions'
addresses and its Mooncake session ("host:port", P2P handshake mode: no metadata server); the
receiver reads them one-sidedly into a staging buffer, copies that into its regions and answers
done. Both ends must use this backend: a zmq receiver drops a pull as malformed, and a zmq
sender's offer is failed here.

Ownership. Mooncake cannot cancel a read it has started. So the receiver reads into memory of
its own (`mooncake_reader`) rather than the caller's regions, which lets a receive fail at its
deadline even while a read is stuck; the one copy matches the zmq backend's. And the sender,
once a receiver accepted, keeps its source regions until that receiver's done or fail, or
`ABORT_GRACE_S` past the send's deadline (the receiver stops waiting for the read by then),
before it reports the send: the send's result may come up to that much later than its deadline.
Only a shutdown (or a new `connect` to the same peer, which replaces the connection) reports it
sooner. After the result Mooncake may still serve a read already under way from the source
memory (never write it); unregistering the buffer makes Mooncake refuse any further read of it.

Security: the handshake guards the control connection only. Mooncake listens on two ports of
its own, its handshake port (`get_rpc_port`) and its TCP data port, and binds both to every
interface whatever `bind_host` says (0.0.0.0 and [::]; Mooncake has no option to bind them to
an address). Whoever reaches them, without the handshake or the secret, can learn the
registered buffers' addresses from the handshake port and read and overwrite any registered
memory through the data port: the caller's KV buffers and the reader's staging buffers. So the
engine logs a warning at start: firewall those ports to the peers, or use the zmq backend.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from types import ModuleType

import zmq

from kvtier.transport import protocol
from kvtier.transport.base import (
    BackendUnavailableError,
    BufferId,
    TransferId,
    TransportError,
)
from kvtier.transport.config import TransportConfig
from kvtier.transport.handshake import LocalIdentity
from kvtier.transport.mooncake_reader import Read, Reader, address_of
from kvtier.transport.zmq_engine import ZmqTransferEngine
from kvtier.transport.zmq_loop import IOLoop
from kvtier.transport.zmq_state import Offer, Receiving, Sending

logger = logging.getLogger(__name__)

# Covers the time a receiver's done or fail takes to arrive after the sender's deadline.
ABORT_GRACE_S = 0.5
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


def _load_mooncake() -> ModuleType:
    try:
        import mooncake.engine
    except ImportError as exc:
        raise BackendUnavailableError(
            f"the mooncake transport needs Mooncake's transfer engine ({exc}): "
            f"pip install 'kvtier[mooncake]' (and apt-get install libibverbs1), or choose "
            f"the zmq transport") from exc
    return mooncake.engine


@dataclass(kw_only=True)
class Pull(Offer):
    """A pull offer: where the sender's regions are (its deadline: when the sender stops
    waiting)."""

    session: str
    addrs: list[int]


class MooncakeLoop(IOLoop):
    """The zmq I/O loop with pulls instead of offers and data frames."""

    TRANSFER_KINDS = ("pull", "offer", "fail")

    def __init__(self, *args, reader: Reader, session: str) -> None:
        super().__init__(*args)
        self.reader, self.session = reader, session

    # ---- sending side ------------------------------------------------------------------------

    def _send_offer(self, sending: Sending) -> None:
        ttl_ms = max(1, int((sending.deadline - time.monotonic()) * 1000))
        self._send(sending.conn, [protocol.encode(
            "pull", id=sending.transfer_id, sizes=[len(v) for v in sending.views],
            session=self.session, addrs=[address_of(v) for v in sending.views], ttl_ms=ttl_ms)])

    def _on_accept(self, sending: Sending, offset: int) -> None:
        # The receiver started reading: it has until our deadline to finish, and we keep the
        # source until it says so (see the module docstring).
        sending.deadline += ABORT_GRACE_S

    # ---- receiving side ----------------------------------------------------------------------

    def _on_offer(self, source: bytes, msg: dict, _frames) -> None:
        self._fail_to(source, TransferId(msg["id"]), "the receiver uses the mooncake transport "
                      "and the sender another; choose the same transport on both")

    def _on_pull(self, source: bytes, msg: dict, _frames) -> None:
        self._take_offer(TransferId(msg["id"]), Pull(
            source, msg["sizes"], time.monotonic() + msg["ttl_ms"] / 1000,
            session=msg["session"], addrs=msg["addrs"]))

    def _match(self, receiving: Receiving, offer: Pull) -> bool:
        if not super()._match(receiving, offer):
            return False  # the sizes differ: both sides were failed
        # A read that ends after the sender stopped waiting may hold bytes it overwrote.
        receiving.deadline = min(receiving.deadline, offer.deadline)
        if receiving.deadline > time.monotonic():  # else `_expire` fails it, unread
            self.reader.start(Read(receiving, offer.session, offer.addrs, offer.sizes))
        return True

    def _release(self) -> None:
        for read in self.reader.take_ended():
            self._finish_read(read)
        super()._release()

    def _finish_read(self, read: Read) -> None:
        receiving = read.receiving
        if self.recvs.get(receiving.transfer_id) is not receiving:
            self.counts["late_messages"] += 1  # failed meanwhile (deadline, sender, shutdown)
            return
        if read.error is not None:
            self._fail_both(receiving, read.error)
        else:  # every byte at once: copied in, then done
            self._take_data(receiving, [memoryview(read.staging)])


class MooncakeTransferEngine(ZmqTransferEngine):
    """See `TransferEngine` and the module docstring. Needs the `mooncake` extra."""

    def __init__(self, config: TransportConfig, engine_id: str | None = None) -> None:
        if config.bind_host in _WILDCARD_HOSTS:
            raise TransportError("the mooncake transport names itself to peers by bind_host: "
                                 "give an address they can reach, not a wildcard")
        self._mooncake = _load_mooncake().TransferEngine()
        if self._mooncake.initialize(config.bind_host, "P2PHANDSHAKE", "tcp", "") != 0:
            raise TransportError(f"Mooncake's transfer engine did not start on "
                                 f"{config.bind_host} (see its log above)")
        self._session = f"{config.bind_host}:{self._mooncake.get_rpc_port()}"
        logger.warning(
            "transport: Mooncake's handshake port %d and its data port listen on all "
            "interfaces, whatever bind_host says, and let anyone who reaches them read and "
            "overwrite every registered buffer, without the handshake or the secret: firewall "
            "them to the peers, or use the zmq transport", self._mooncake.get_rpc_port())
        self._addresses: dict[BufferId, int] = {}
        self._reader = Reader(self._mooncake, on_ended=self._wake_loop)
        try:
            super().__init__(config, engine_id)
        except BaseException:
            self._reader.stop(timeout_s=0)
            raise

    def _make_loop(self, listener: zmq.Socket, wake: zmq.Socket, local: LocalIdentity) -> IOLoop:
        return MooncakeLoop(self._ctx, listener, wake, local, self._state, self.config,
                            self._on_result, reader=self._reader, session=self._session)

    def register_buffer(self, buffer_id: BufferId, buffer: memoryview) -> None:
        super().register_buffer(buffer_id, buffer)
        view = memoryview(buffer)
        if not view.nbytes:
            return  # no region can name an empty buffer: nothing for Mooncake to serve
        address = address_of(view)
        if self._mooncake.register_memory(address, view.nbytes) != 0:
            super().unregister_buffer(buffer_id)
            raise TransportError(f"Mooncake could not register buffer {buffer_id!r}")
        with self._lock:
            self._addresses[buffer_id] = address

    def unregister_buffer(self, buffer_id: BufferId) -> None:
        super().unregister_buffer(buffer_id)
        with self._lock:
            address = self._addresses.pop(buffer_id, None)
        if address is not None:
            self._mooncake.unregister_memory(address)

    def shutdown(self, timeout_s: float) -> None:
        start = time.monotonic()
        super().shutdown(timeout_s)
        self._reader.stop(timeout_s=max(0.0, start + timeout_s - time.monotonic()))
        # Peers' reads of our buffers are refused from now on; Mooncake's listeners themselves
        # close when this engine is collected (its Python API has no close).
        with self._lock:
            addresses, self._addresses = list(self._addresses.values()), {}
        for address in addresses:
            self._mooncake.unregister_memory(address)
