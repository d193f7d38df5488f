"""P2PConnector's worker half: the transfer engine, and copies between it and the paged cache.

A request's KV crosses as one transfer per layer out of one layer-major host buffer (see
`layout.py`). A producer fills that buffer either as each layer of the forward pass is computed,
sending each layer once the prompt's last full block is in (push "layer"), or from the
request's blocks at the step after it finished, sending every layer then (push "request").
Either way the request's blocks stay allocated until its sends end, since the engine steps (and
so collects transfer results) only while a finished request holds blocks. A
consumer receives every layer into its own host buffer and copies the blocks it needs into the
paged cache once all of them arrived; one failed layer fails the load.

A producer's sends never wait for a connection inside the step: a layer whose connection to
its consumer is not up yet waits on the transfer (`waiting`) and goes out at a later step's
`get_finished` once it is (see `peers.py`). A layer whose send failed because its connection
closed before the send's deadline is sent once more, on a new connection.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from kvtier.connector.base import ConnectorContext, KVConnectorWorker
from kvtier.connector.config import KVTransferConfig, parse_options
from kvtier.connector.counters import ConnectorCounters
from kvtier.connector.p2p.layout import (
    LayerMajorPayload,
    layer_transfer_id,
    split_layer_transfer_id,
)
from kvtier.connector.p2p.metadata import BlockLoad, BlockSend, LayerPush, P2PConnectorOptions
from kvtier.connector.p2p.peers import PeerConnections
from kvtier.transport import (
    BufferId,
    Direction,
    HandshakeError,
    PeerId,
    TransferResult,
    TransportConfig,
    TransportError,
    load_secret,
    make_transfer_engine,
)

logger = logging.getLogger(__name__)
_COUNTED = ("requests_sent", "send_errors", "sends_refused", "blocks_loaded", "load_errors")
# Sends still in flight at shutdown get this long (a consumer may be waiting for them).
_SHUTDOWN_TIMEOUT_S = 10.0


@dataclass
class _Transfer:
    """One request's KV crossing in one direction: its host buffer and its layers not ended."""

    req_id: str
    transfer_id: str
    direction: Direction
    payload: LayerMajorPayload
    num_layers_left: int
    load: BlockLoad | None = None
    error: str | None = None
    # A send's consumer, the connection to it, and the layers that wait for that connection.
    address: str = ""
    connection: Future[PeerId] | None = None
    waiting: list[int] = field(default_factory=list)
    # The peer and deadline of the first layer sent; the layers sent a second time.
    sent_to: PeerId | None = None
    deadline: float = 0.0
    resent: set[int] = field(default_factory=set)

    @property
    def buffer_id(self) -> BufferId:
        # An instance that both produces and consumes may send and receive the same id.
        return BufferId(f"{self.direction.value}:{self.transfer_id}")


class P2PConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, context: ConnectorContext) -> None:
        super().__init__(config, context)
        options = parse_options(P2PConnectorOptions, config.kv_connector_extra_config,
                                "P2PConnector extra config")
        self.options = options
        self.transport = make_transfer_engine(TransportConfig(
            namespace=context.namespace, bind_host=options.bind_host, port=options.port,
            secret=load_secret(), backend=options.transport,
            unclaimed_offer_timeout_s=options.unclaimed_offer_timeout_s))
        self._connections = PeerConnections(self.transport, options.connect_timeout_s)
        # (direction, transfer id) -> the transfer whose layers the transport is moving.
        self._open: dict[tuple[Direction, str], _Transfer] = {}
        # Layer-wise pushes by request id, from their first chunk until the request finishes.
        self._pushing: dict[str, _Transfer] = {}
        self._step_pushes: list[tuple[LayerPush, _Transfer]] = []
        # Pushed requests the scheduler has not finished yet, and those of them whose sends
        # ended: the scheduler frees a request's blocks on a finished_sending that comes after
        # it finished the request, and ignores an earlier one.
        self._unfinished: set[str] = set()
        self._sent_early: set[str] = set()
        self._load_errors: set[int] = set()
        self._finished_sending: set[str] = set()
        self._finished_recving: set[str] = set()
        # Transport results taken while waiting, for the next get_finished.
        self._landed: list[TransferResult] = []
        self._counts = ConnectorCounters("p2p_connector", "P2PConnector", _COUNTED,
                                         context.metrics)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        super().register_kv_caches(kv_caches)
        self._layer_index = {name: i for i, name in enumerate(kv_caches)}

    @property
    def address(self) -> str:
        """Where producers send this instance's KV (its consumer_address)."""
        return self.transport.address

    @property
    def num_open_transfers(self) -> int:
        """Transfers whose host buffer the transport still holds (sends and loads)."""
        return len(self._open)

    # ---- starting transfers ---------------------------------------------------------------------

    def start_load_kv(self, forward_context: object) -> None:
        meta = self.connector_metadata
        for req_id in meta.dropped_pushes:
            self._drop_push(req_id)
        for send in meta.sends:
            self._start_send(send)
        for load in meta.loads:
            self._start_load(load)
        self._step_pushes = [(push, self._push_of(push)) for push in meta.pushes]

    def _open_transfer(self, req_id: str, transfer_id: str, direction: Direction,
                       num_blocks: int) -> _Transfer:
        """A transfer with its host buffer registered, or failed (`error`) when it cannot be."""
        transfer = _Transfer(req_id, transfer_id, direction,
                             LayerMajorPayload(self.kv_caches, num_blocks), len(self.kv_caches))
        try:
            self.transport.register_buffer(transfer.buffer_id,
                                           memoryview(transfer.payload.buffer.numpy()))
        except TransportError as exc:
            transfer.error = str(exc)  # e.g. the id is in use by another request
            return transfer
        self._open[(direction, transfer_id)] = transfer
        return transfer

    def _connect(self, transfer: _Transfer, address: str) -> None:
        transfer.address = address
        transfer.connection = self._connections.get(address)

    def _start_send(self, send: BlockSend) -> None:
        transfer = self._open_transfer(send.req_id, send.transfer_id, Direction.SEND,
                                       len(send.block_ids))
        if transfer.error is None:
            for i, cache in enumerate(self.kv_caches.values()):
                transfer.payload.copy_out(i, 0, cache, send.block_ids)
            self._connect(transfer, send.consumer_address)
        for i in range(transfer.payload.num_layers):
            self._send_layer(transfer, i)

    def _push_of(self, push: LayerPush) -> _Transfer:
        transfer = self._pushing.get(push.req_id)
        if transfer is None:
            transfer = self._open_transfer(push.req_id, push.transfer_id, Direction.SEND,
                                           push.num_blocks)
            if transfer.error is None:
                self._connect(transfer, push.consumer_address)
            self._pushing[push.req_id] = transfer
            self._unfinished.add(push.req_id)
        return transfer

    def _send_layer(self, transfer: _Transfer, layer_index: int) -> None:
        """Send one layer as soon as the transfer's connection is up (now, if it is)."""
        if transfer.error is not None:
            self._end_layer(transfer, transfer.error)
            return
        transfer.waiting.append(layer_index)
        self._send_waiting(transfer)

    def _send_waiting(self, transfer: _Transfer) -> None:
        """Send the layers that wait for the transfer's connection once it is up; fail them
        when it failed."""
        if not transfer.waiting or not transfer.connection.done():
            return
        layers, transfer.waiting = transfer.waiting, []
        exc = transfer.connection.exception()
        if exc is not None and transfer.error is None:
            transfer.error = f"cannot reach {transfer.address}: {exc}"
            if isinstance(exc, HandshakeError):
                # Another KV namespace or secret: operators need to tell it from a dead peer.
                self._counts.add("sends_refused", 1)
        for layer_index in layers:
            self._send_now(transfer, layer_index)

    def _send_now(self, transfer: _Transfer, layer_index: int) -> None:
        if transfer.error is None:
            peer = transfer.connection.result()
            try:
                self.transport.send(peer, layer_transfer_id(transfer.transfer_id, layer_index),
                                    [transfer.payload.region(transfer.buffer_id, layer_index)],
                                    self.options.send_timeout_s)
                if transfer.sent_to is None:
                    transfer.sent_to = peer
                    transfer.deadline = time.monotonic() + self.options.send_timeout_s
                return
            except TransportError as exc:
                transfer.error = str(exc)
        self._end_layer(transfer, transfer.error)

    def _may_resend(self, transfer: _Transfer, layer_index: int, error: str | None) -> bool:
        """Whether a failed layer send is worth a second one: its connection closed before
        the transfer's deadline (the consumer restarted, or another send's deadline closed
        it), so its consumer may still be waiting for it."""
        return (error is not None and transfer.direction is Direction.SEND
                and transfer.error is None and layer_index not in transfer.resent
                and time.monotonic() < transfer.deadline
                and not self.transport.is_connected(transfer.sent_to))

    def _resend(self, transfer: _Transfer, layer_index: int) -> None:
        if not transfer.resent:  # the first layer back connects again, for every other
            transfer.connection = self._connections.get(transfer.address)
        transfer.resent.add(layer_index)
        self._send_layer(transfer, layer_index)

    def _start_load(self, load: BlockLoad) -> None:
        transfer = self._open_transfer(load.req_id, load.transfer_id, Direction.RECV,
                                       load.num_remote_blocks)
        transfer.load = load
        for i in range(transfer.payload.num_layers):
            if transfer.error is None:
                try:
                    self.transport.recv(layer_transfer_id(load.transfer_id, i),
                                        [transfer.payload.region(transfer.buffer_id, i)],
                                        self.config.kv_load_timeout_s)
                    continue
                except TransportError as exc:
                    transfer.error = str(exc)
            self._end_layer(transfer, transfer.error)

    def _drop_push(self, req_id: str) -> None:
        transfer = self._pushing.pop(req_id, None)
        self._unfinished.discard(req_id)
        # No layer of it was sent: the transport holds nothing of it.
        if transfer is not None and self._open.get((Direction.SEND, transfer.transfer_id)) \
                is transfer:
            del self._open[(Direction.SEND, transfer.transfer_id)]
            self.transport.unregister_buffer(transfer.buffer_id)

    # ---- the forward pass -----------------------------------------------------------------------

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: object) -> None:
        layer_index = self._layer_index[layer_name]
        for push, transfer in self._step_pushes:
            transfer.payload.copy_out(layer_index, push.first_block, kv_layer, push.block_ids)
            if push.is_last:
                self._send_layer(transfer, layer_index)

    def wait_for_save(self) -> None:
        # The copies in save_kv_layer are synchronous: nothing of this step is left to wait for.
        for push, _ in self._step_pushes:
            if push.is_last:
                self._pushing.pop(push.req_id)
        self._step_pushes = []

    # ---- ending transfers -----------------------------------------------------------------------

    def wait_for_transfers(self, timeout_s: float) -> None:
        # Woken by the transport's first result rather than after the whole timeout.
        self._landed += self.transport.get_finished(timeout_s)

    def interrupt_wait(self) -> None:
        self.transport.interrupt_get_finished()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        landed, self._landed = self._landed + self.transport.get_finished(), []
        for result in landed:
            transfer_id, layer_index = split_layer_transfer_id(result.transfer_id)
            transfer = self._open[(result.direction, transfer_id)]
            if self._may_resend(transfer, layer_index, result.error):
                self._resend(transfer, layer_index)
            else:
                self._end_layer(transfer, result.error)
        for transfer in [t for t in self._open.values() if t.waiting]:
            self._send_waiting(transfer)
        self._unfinished -= finished_req_ids
        ready = self._sent_early - self._unfinished
        self._sent_early -= ready
        sending, self._finished_sending = self._finished_sending | ready, set()
        recving, self._finished_recving = self._finished_recving, set()
        return sending, recving

    def _end_layer(self, transfer: _Transfer, error: str | None) -> None:
        """One layer's transfer ended (or was never started); the last one ends the transfer."""
        transfer.error = transfer.error or error
        transfer.num_layers_left -= 1
        if transfer.num_layers_left > 0:
            return
        key = (transfer.direction, transfer.transfer_id)
        if self._open.get(key) is transfer:
            del self._open[key]
            self.transport.unregister_buffer(transfer.buffer_id)
        if transfer.direction is Direction.SEND:
            self._end_send(transfer)
        elif not transfer.load.is_drain:
            self._finished_recving.add(transfer.req_id)
            self._finish_load(transfer)

    def _end_send(self, transfer: _Transfer) -> None:
        if transfer.error is not None:
            logger.warning("P2PConnector: cannot send request %s: %s", transfer.req_id,
                           transfer.error)
        self._counts.add("requests_sent" if transfer.error is None else "send_errors", 1)
        if transfer.req_id in self._unfinished:
            self._sent_early.add(transfer.req_id)
        else:
            self._finished_sending.add(transfer.req_id)

    def _finish_load(self, transfer: _Transfer) -> None:
        load = transfer.load
        if transfer.error is not None:
            logger.warning("P2PConnector: load of request %s failed: %s", transfer.req_id,
                           transfer.error)
            self._load_errors |= set(load.block_ids)
            self._counts.add("load_errors", len(load.block_ids))
            return
        with torch.inference_mode():
            for i, cache in enumerate(self.kv_caches.values()):
                transfer.payload.copy_in(i, load.first_block, cache, load.block_ids)
        self._counts.add("blocks_loaded", len(load.block_ids))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_stats(self) -> dict[str, float]:
        return self._counts.take()

    def shutdown(self) -> None:
        self.transport.shutdown(timeout_s=min(_SHUTDOWN_TIMEOUT_S, self.options.send_timeout_s))
