"""Both ends of a zmq transfer, as parts of the I/O loop (`zmq_loop.IOLoop`), which owns the
sockets and provides `_send`, `_reply`, `_end_send` and `_report`.

    sender                                      receiver
    offer {id, sizes, ttl_ms} + first bytes  ->          kept while its recv is not posted
                                             <-  accept {id, offset}   (none: every byte came)
    data {id, offset} + up to 4 MiB          ->          copied in while the next one arrives
    data ...                                 ->
                                             <-  done {id}   once every byte is here

The first EAGER_BYTES go with the offer, so a small transfer whose recv is posted costs one
round trip, and a large one's accept comes back while its first bytes are on the wire. A
receiver keeps such bytes for offers whose recv is not yet posted up to MAX_KEPT_EAGER_BYTES
in all; beyond that it drops them and its accept asks for them again (`offset` 0). The rest
goes as data messages of DATA_MESSAGE_BYTES, each a zero-copy view of the caller's regions,
so the receiver's copy into its regions overlaps the wire and zmq never holds one huge
message. Data messages must arrive in order (`offset`); a receive is done only once it holds
every offered byte, so one whose sender died midway fails at its deadline. The done goes out
before the last piece is copied in: the sender's source is no longer needed, and nothing can
fail that copy. An offer whose recv is not posted within `unclaimed_offer_timeout_s` (when set)
is failed back, so that its sender lets go of its source before its own deadline.
"""

from __future__ import annotations

import time
from collections import OrderedDict

import zmq

from kvtier.transport import protocol
from kvtier.transport.base import Direction, TransferId
from kvtier.transport.protocol import DATA_MESSAGE_BYTES, EAGER_BYTES
from kvtier.transport.zmq_state import Offer, Receiving, Sending, cut, scatter

# Offers that wait for a matching recv; beyond this a peer is told the receiver is busy.
MAX_UNMATCHED_OFFERS = 4096
# What offers waiting for their recv may hold of such bytes; beyond it they are dropped, and
# sent again after the accept.
MAX_KEPT_EAGER_BYTES = 64 << 20
# Ids of offers failed back unclaimed that are remembered, so that a late recv for one fails
# at once rather than at its deadline; the least recent is forgotten beyond.
MAX_UNCLAIMED_REMEMBERED = 4096


class SenderSide:
    """The sending end: offers, then data messages once accepted."""

    def _send_offer(self, sending: Sending) -> None:
        """Offer the transfer with its first bytes: a small one whose recv is posted then
        needs no accept, a large one's accept comes back while those bytes are on the wire."""
        ttl_ms = max(1, int((sending.deadline - time.monotonic()) * 1000))
        header = protocol.encode("offer", id=sending.transfer_id,
                                 sizes=[len(view) for view in sending.views], ttl_ms=ttl_ms)
        sending.num_eager_bytes = min(EAGER_BYTES, sum(len(view) for view in sending.views))
        self._send_payload(sending, header, 0, sending.num_eager_bytes)

    def _on_accept(self, sending: Sending, offset: int) -> None:
        """Send the bytes from `offset` on (what the receiver did not keep of the offer's) as
        data messages: the receiver copies each while the next one is on the wire."""
        if offset > sending.num_eager_bytes:
            self._fail_send(sending, f"the receiver accepted from byte {offset}, beyond the "
                                     f"{sending.num_eager_bytes} it was sent")
            return
        num_bytes = sum(len(view) for view in sending.views)
        for start in range(offset, num_bytes, DATA_MESSAGE_BYTES):
            if sending.ended:
                return  # its connection failed
            header = protocol.encode("data", id=sending.transfer_id, offset=start)
            self._send_payload(sending, header, start, min(start + DATA_MESSAGE_BYTES, num_bytes))

    def _fail_send(self, sending: Sending, error: str) -> None:
        """End a send failed, and tell its receiver (unless the connection is gone)."""
        self._send(sending.conn, [protocol.encode("fail", id=sending.transfer_id, error=error)])
        if not sending.ended:  # the send above did not close the connection, ending it
            self._end_send(sending, error)

    def _send_payload(self, sending: Sending, header: bytes, start: int, stop: int) -> None:
        """Send `header` and bytes `start:stop` of the transfer, zero-copy, tracked."""
        frames = [header, *cut(sending.views, start, stop)]
        tracker = self._send(sending.conn, frames, track=True)
        if tracker is not None:
            sending.trackers.append(tracker)


class ReceiverSide:
    """The receiving end: offers waiting for their recv, matching, copying, done."""

    counts: dict[str, int]
    recvs: dict[TransferId, Receiving]
    offers: dict[TransferId, Offer]
    # Payload bytes the waiting offers hold (at most MAX_KEPT_EAGER_BYTES).
    num_kept_bytes: int
    unclaimed_offer_timeout_s: float | None
    # Offers failed back unclaimed, least recent first (at most MAX_UNCLAIMED_REMEMBERED).
    unclaimed: OrderedDict[TransferId, None]

    def _start_recv(self, receiving: Receiving) -> None:
        if receiving.transfer_id in self.unclaimed:
            del self.unclaimed[receiving.transfer_id]
            self._report(receiving.transfer_id, Direction.RECV,
                         f"its offer came and waited {self.unclaimed_offer_timeout_s} s for "
                         f"this recv; its sender was told to give up")
            return
        self.recvs[receiving.transfer_id] = receiving
        offer = self._pop_offer(receiving.transfer_id)
        # An offer past its deadline is one its sender has given up on (or is about to), even
        # if the deadline sweep has not dropped it yet: this recv waits for a new one.
        if offer is not None and time.monotonic() < offer.deadline:
            self._match(receiving, offer)

    def _on_offer(self, source: bytes, msg: dict, frames: list[zmq.Frame]) -> None:
        deadline = time.monotonic() + msg["ttl_ms"] / 1000
        self._take_offer(TransferId(msg["id"]), Offer(source, msg["sizes"], deadline,
                                                      [frame.buffer for frame in frames]))

    def _take_offer(self, tid: TransferId, offer: Offer) -> None:
        self.unclaimed.pop(tid, None)  # sent again: a recv may take this one
        receiving = self.recvs.get(tid)
        if tid in self.offers or (receiving is not None and receiving.source is not None):
            self._fail_to(offer.source, tid, "a transfer with this id is already in progress")
        elif receiving is not None:
            self._match(receiving, offer)
        elif len(self.offers) >= MAX_UNMATCHED_OFFERS:
            self._fail_to(offer.source, tid, "receiver has too many offers waiting for a recv")
        else:
            if offer.num_payload_bytes > MAX_KEPT_EAGER_BYTES - self.num_kept_bytes:
                offer.payload = []  # no room: the accept will ask the sender for every byte
            self.num_kept_bytes += offer.num_payload_bytes
            if self.unclaimed_offer_timeout_s is not None:
                offer.claim_by = time.monotonic() + self.unclaimed_offer_timeout_s
            self.offers[tid] = offer

    def _pop_offer(self, tid: TransferId) -> Offer | None:
        offer = self.offers.pop(tid, None)
        if offer is not None:
            self.num_kept_bytes -= offer.num_payload_bytes
        return offer

    def _match(self, receiving: Receiving, offer: Offer) -> bool:
        """Take `offer` for `receiving`: an accept for the bytes it did not bring, then those
        it brought. False when that ended the receive (every byte came, or it was refused)."""
        offered, wanted = sum(offer.sizes), receiving.num_bytes
        receiving.source = offer.source
        if offered != wanted:
            self._fail_both(receiving, f"sender offers {offered} bytes, receiver expects {wanted}")
            return False
        if offer.num_payload_bytes < wanted:  # first, so that the rest comes while we copy
            self._reply(offer.source, protocol.encode("accept", id=receiving.transfer_id,
                                                      offset=offer.num_payload_bytes))
        return self._take_data(receiving, offer.payload)

    def _on_data(self, source: bytes, msg: dict, frames: list[zmq.Frame]) -> None:
        receiving = self.recvs.get(TransferId(msg["id"]))
        if receiving is None or receiving.source != source:
            self.counts["late_messages"] += 1  # its recv already failed (deadline) or never was
        elif msg["offset"] != receiving.num_received:
            self._fail_both(receiving, f"data from byte {msg['offset']}, expected byte "
                                       f"{receiving.num_received}")
        else:
            self._take_data(receiving, [frame.buffer for frame in frames])

    def _take_data(self, receiving: Receiving, payload: list[memoryview]) -> bool:
        """Copy `payload` into `receiving` where its bytes so far end, while the next message
        is on the wire; True while bytes are still due. Done only once every byte is here."""
        num_bytes = sum(len(part) for part in payload)
        if receiving.num_received + num_bytes > receiving.num_bytes:
            self._fail_both(receiving, "the sender sent more bytes than it offered")
            return False
        complete = receiving.num_received + num_bytes == receiving.num_bytes
        if complete:
            # Every byte is in our memory, and nothing can fail the copy below: the sender
            # may let go of its source while we copy.
            self._reply(receiving.source, protocol.encode("done", id=receiving.transfer_id))
        scatter(payload, receiving.views, receiving.num_received)
        receiving.num_received += num_bytes
        if not complete:
            return True
        self.counts["bytes_received"] += receiving.num_bytes
        self._end_recv(receiving, None)
        return False

    def _on_fail(self, source: bytes, msg: dict, _frames) -> None:
        tid = TransferId(msg["id"])
        receiving = self.recvs.get(tid)
        if receiving is not None and receiving.source == source:
            self._end_recv(receiving, f"sender failed: {msg['error']}")
        elif tid in self.offers and self.offers[tid].source == source:
            self._pop_offer(tid)

    def _forget_source(self, source: bytes) -> None:
        """Its sender closed the connection `source`, failing every transfer on it, and may
        offer some of them again on its new connection (as the P2PConnector does): its
        waiting offers are dropped, and receives matched to it wait for a new offer."""
        for tid in [tid for tid, offer in self.offers.items() if offer.source == source]:
            self._pop_offer(tid)
        for receiving in [r for r in self.recvs.values() if r.source == source]:
            # A new receive from byte 0: whatever still arrives for the old one (a backend's
            # read under way) finds it gone and is dropped as late.
            self.recvs[receiving.transfer_id] = Receiving(receiving.transfer_id, receiving.views,
                                                          receiving.deadline)

    def _fail_unclaimed(self, tid: TransferId) -> None:
        """Fail back an offer whose recv was not posted in time: its sender lets go of its
        source now, not at its deadline."""
        offer = self._pop_offer(tid)
        self._fail_to(offer.source, tid, f"the receiver posted no recv for it within "
                                         f"{self.unclaimed_offer_timeout_s} s")
        self.unclaimed[tid] = None
        if len(self.unclaimed) > MAX_UNCLAIMED_REMEMBERED:
            self.unclaimed.popitem(last=False)

    def _fail_to(self, source: bytes, tid: TransferId, error: str) -> None:
        self._reply(source, protocol.encode("fail", id=tid, error=error))

    def _fail_both(self, receiving: Receiving, error: str) -> None:
        """End a matched receive failed, and tell its sender."""
        self._fail_to(receiving.source, receiving.transfer_id, error)
        self._end_recv(receiving, error)

    def _end_recv(self, receiving: Receiving, error: str | None) -> None:
        del self.recvs[receiving.transfer_id]
        self._report(receiving.transfer_id, Direction.RECV, error)
