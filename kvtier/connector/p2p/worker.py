"""P2PConnector's worker half: the transfer engine, and copies between it and the paged cache.

A send copies the request's blocks (block after block, each layer's (2, block_size, kv_heads,
head_dim) in turn) into one host buffer and hands it to the transfer engine; a load receives
that buffer and copies the blocks it needs into the paged cache once the transfer is done.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from kvtier.connector.base import ConnectorContext, KVConnectorWorker
from kvtier.connector.config import KVTransferConfig, parse_options
from kvtier.connector.counters import ConnectorCounters
from kvtier.connector.p2p.metadata import BlockLoad, BlockSend, P2PConnectorOptions
from kvtier.transport import (
    BufferId,
    Direction,
    HandshakeError,
    PeerId,
    Region,
    TransferId,
    TransportConfig,
    TransportError,
    load_secret,
    make_transfer_engine,
)

logger = logging.getLogger(__name__)
_CONNECT_TIMEOUT_S = 5.0
_COUNTED = ("requests_sent", "send_errors", "sends_refused", "blocks_loaded", "load_errors")
# Sends still in flight at shutdown get this long (a consumer may be waiting for them).
_SHUTDOWN_TIMEOUT_S = 10.0


def _buffer_id(direction: Direction, transfer_id: str) -> BufferId:
    # An instance that both produces and consumes may send and receive the same id.
    return BufferId(f"{direction.value}:{transfer_id}")


@dataclass
class _Pending:
    req_id: str
    # Keeps the host copy alive while the engine uses it.
    payload: torch.Tensor
    load: BlockLoad | None = None


class P2PConnectorWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig, context: ConnectorContext) -> None:
        super().__init__(config, context)
        options = parse_options(P2PConnectorOptions, config.kv_connector_extra_config,
                                "P2PConnector extra config")
        self.options = options
        self.transport = make_transfer_engine(TransportConfig(
            namespace=context.namespace, bind_host=options.bind_host, port=options.port,
            secret=load_secret(), backend=options.transport))
        self._peers: dict[str, PeerId] = {}
        self._pending: dict[tuple[Direction, str], _Pending] = {}
        self._load_errors: set[int] = set()
        # Requests whose send failed before it started; reported as finished sending.
        self._sent_failed: set[str] = set()
        self._counts = ConnectorCounters("p2p_connector", "P2PConnector", _COUNTED,
                                         context.metrics)

    @property
    def address(self) -> str:
        """Where producers send this instance's KV (its consumer_address)."""
        return self.transport.address

    def _block_bytes(self) -> int:
        return sum(cache[:, 0].nbytes for cache in self.kv_caches.values())

    def start_load_kv(self, forward_context: object) -> None:
        for send in self.connector_metadata.sends:
            self._start_send(send)
        for load in self.connector_metadata.loads:
            payload = torch.empty(load.num_remote_blocks * self._block_bytes(), dtype=torch.uint8)
            self._post(Direction.RECV, load.req_id, load.transfer_id, payload, load)
            self.transport.recv(TransferId(load.transfer_id),
                                [Region(_buffer_id(Direction.RECV, load.transfer_id), 0,
                                        payload.numel())],
                                self.config.kv_load_timeout_s)

    def _start_send(self, send: BlockSend) -> None:
        # (2, block_size, kv_heads, head_dim) of each layer, block after block.
        payload = torch.cat([cache[:, block_id].reshape(-1).view(torch.uint8)
                             for block_id in send.block_ids for cache in self.kv_caches.values()])
        try:
            peer = self._peers.get(send.consumer_address)
            if peer is None:
                peer = self.transport.connect(send.consumer_address, _CONNECT_TIMEOUT_S)
                self._peers[send.consumer_address] = peer
            self._post(Direction.SEND, send.req_id, send.transfer_id, payload, None)
            self.transport.send(peer, TransferId(send.transfer_id),
                                [Region(_buffer_id(Direction.SEND, send.transfer_id), 0,
                                        payload.numel())],
                                self.options.send_timeout_s)
        except (TransportError, TimeoutError, ConnectionError) as exc:
            logger.warning("P2PConnector: cannot send request %s to %s: %s", send.req_id,
                           send.consumer_address, exc)
            self._pending.pop((Direction.SEND, send.transfer_id), None)
            self._unregister(Direction.SEND, send.transfer_id)
            self._sent_failed.add(send.req_id)
            if isinstance(exc, HandshakeError):
                # Another KV namespace or secret: operators need to tell it from a dead peer.
                self._counts.add("sends_refused", 1)

    def _post(self, direction: Direction, req_id: str, transfer_id: str, payload: torch.Tensor,
              load: BlockLoad | None) -> None:
        self.transport.register_buffer(_buffer_id(direction, transfer_id),
                                       memoryview(payload.numpy()))
        self._pending[(direction, transfer_id)] = _Pending(req_id, payload, load)

    def _unregister(self, direction: Direction, transfer_id: str) -> None:
        try:
            self.transport.unregister_buffer(_buffer_id(direction, transfer_id))
        except TransportError:
            pass  # never registered: the send failed before

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str], set[str]]:
        sending, recving = self._sent_failed, set()
        self._sent_failed = set()
        self._counts.add("send_errors", len(sending))
        for result in self.transport.get_finished():
            pending = self._pending.pop((result.direction, result.transfer_id))
            if result.direction is Direction.SEND:
                sending.add(pending.req_id)
                self._counts.add("requests_sent" if result.ok else "send_errors", 1)
            elif not pending.load.is_drain:
                recving.add(pending.req_id)
                self._finish_load(pending, result.error)
            self._unregister(result.direction, result.transfer_id)
        return sending, recving

    def _finish_load(self, pending: _Pending, error: str | None) -> None:
        load = pending.load
        if error is not None:
            logger.warning("P2PConnector: load of request %s failed: %s", pending.req_id, error)
            self._load_errors |= set(load.block_ids)
            self._counts.add("load_errors", len(load.block_ids))
            return
        block_bytes = self._block_bytes()
        with torch.inference_mode():
            for i, block_id in enumerate(load.block_ids):
                start = (load.first_block + i) * block_bytes
                for cache in self.kv_caches.values():
                    block_kv = cache[:, block_id]  # (2, block_size, kv_heads, head_dim)
                    end = start + block_kv.nbytes
                    block_kv.copy_(pending.payload[start:end].view(cache.dtype)
                                   .view(block_kv.shape))
                    start = end
        self._counts.add("blocks_loaded", len(load.block_ids))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def get_stats(self) -> dict[str, float]:
        return self._counts.take()

    def shutdown(self) -> None:
        self.transport.shutdown(timeout_s=min(_SHUTDOWN_TIMEOUT_S, self.options.send_timeout_s))
