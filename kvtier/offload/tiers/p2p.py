"""The p2p tier: a host-tier miss served from the host memory of other kvtier instances.

With `peers`, a lookup this instance's host tier misses asks the peers which of the chunks they
hold ready in host memory (a batch per step, on the probe thread of tiers/remote.py, so the
lookup answers UNKNOWN meanwhile and never waits), and a promotion fetches the chunk from the
peer that has it, in the checked chunk format: a chunk that fails its check is a miss and a
counted error. With `listen`, the tier serves this instance's host tier to peers
(tiers/p2p_server.py). Both sides run the transport's handshake (kvtier/transport/handshake.py):
a peer with another KV namespace, or without the shared `KVTIER_TRANSPORT_SECRET`, is refused,
counted in `kvtier:offload_p2p_refused`, and costs misses.

The tier stores nothing: a peer's memory is the peer's. Its store jobs are reported skipped
("p2p_never_stores"). A peer that fails a request (dead, slow past `timeout_s`, refused) is not
asked for `_PEER_DOWN_S`, then asked again, so it comes back without a restart.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import zmq

from kvtier.common.bounded import BoundedDict
from kvtier.common.options import require
from kvtier.offload.chunk_format import MAC_BYTES, file_size
from kvtier.offload.keys import ChunkKey
from kvtier.offload.tiers.base import LookupResult, TierContext, TransferJob
from kvtier.offload.tiers.p2p_server import P2PServer
from kvtier.offload.tiers.p2p_wire import MAX_KEYS, PeerClient, PeerRefused
from kvtier.offload.tiers.remote import MissingChunk, RemoteTier, check_remote_options
from kvtier.offload.tiers.threaded import StoreSkipped
from kvtier.transport.base import PeerId
from kvtier.transport.config import load_secret
from kvtier.transport.handshake import LocalIdentity

logger = logging.getLogger(__name__)

# Seconds a peer that failed a request is not asked.
_PEER_DOWN_S = 1.0
# Seconds a peer's "I hold it" is trusted: the peer evicts as it pleases, so a hit is asked
# again after this rather than costing a failed fetch (and that chunk's recompute) much later.
_FOUND_S = 5.0
SKIP_REASON = "p2p_never_stores"


@dataclass(frozen=True)
class P2PTierOptions:
    # The peers' serving sides, "HOST:PORT" each, asked in this order.
    peers: tuple[str, ...] = ()
    # Where this instance serves its host tier to peers ("HOST:PORT"); None: it does not.
    listen: str | None = None
    connect_timeout_s: float = 1.0
    # Deadline of one request to a peer (a batch of lookups, or one chunk).
    timeout_s: float = 2.0
    num_read_threads: int = 2
    num_write_threads: int = 1
    write_nice: int = 10
    max_index_entries: int = 100_000
    max_pending_checks: int = 4096

    def __post_init__(self) -> None:
        require(isinstance(self.peers, (list, tuple)), "p2p.peers",
                "must be a list of \"HOST:PORT\" strings", self.peers)
        object.__setattr__(self, "peers", tuple(self.peers))
        for peer in self.peers:
            _check_address(peer, "p2p.peers")
        if self.listen is not None:
            _check_address(self.listen, "p2p.listen")
        require(self.peers or self.listen is not None, "p2p",
                "needs peers to ask or an address to listen on (or both)", self)
        check_remote_options(self, "p2p")


def _check_address(value: Any, where: str) -> None:
    host, _, port = value.rpartition(":") if isinstance(value, str) else ("", "", "")
    require(bool(host) and port.isdigit() and 0 <= int(port) <= 65535, where,
            "must be HOST:PORT, e.g. 127.0.0.1:7100", value)


class P2PTier(RemoteTier):
    options_cls: ClassVar[type] = P2PTierOptions

    def __init__(self, options: P2PTierOptions, context: TierContext) -> None:
        super().__init__(options, context, store_kind="p2p")
        self._zmq = zmq.Context()
        local = LocalIdentity(PeerId(uuid.uuid4().hex), context.namespace.hex(), load_secret())
        # A reply is one chunk in the checked format: header, key, MAC, payload.
        max_reply = file_size(context.namespace, context.max_chunk_bytes or 1 << 30) \
            + MAC_BYTES + 1024
        self._peers = [PeerClient(self._zmq, f"tcp://{address}", local, max_reply,
                                  options.connect_timeout_s, options.timeout_s)
                       for address in options.peers]
        # Which peer said it holds a key and until when that is trusted, newest last; bounded
        # like the index.
        self._holders: BoundedDict[str, tuple[PeerClient, float]] = BoundedDict(
            options.max_index_entries)
        # refused_<code>: handshakes peers refused.
        self.counts: Counter[str] = Counter()
        self._refused = None
        if context.metrics is not None:
            self._refused = context.metrics.counter(
                "kvtier:offload_p2p_refused",
                "Handshakes with a p2p peer refused (code: namespace, secret, protocol)",
                ["tier", "code"])
        self._server = None
        if options.listen is not None:
            require(context.host is not None, "p2p.listen", "needs the host tier to serve",
                    options.listen)
            self._server = P2PServer(self._zmq, f"tcp://{options.listen}", context.host, local,
                                     context.chunk_secret)

    @property
    def address(self) -> str | None:
        """Where peers reach this instance's serving side (the bound port), or None."""
        return None if self._server is None else self._server.address.removeprefix("tcp://")

    def lookup(self, key: ChunkKey, req_context: Any = None) -> LookupResult:
        if not self._peers:
            return LookupResult.NOT_FOUND  # only serves: nobody to ask
        holder = self._holders.get(key.hex())
        if holder is not None and holder[1] < time.monotonic():
            self._forget(key)  # asked again: the peer may have evicted it since
            self._holders.pop(key.hex(), None)
        return super().lookup(key, req_context)

    def _name(self, key: ChunkKey) -> str:
        return key.hex()

    def _exists_many(self, names: Sequence[str]) -> list[bool]:
        found = [False] * len(names)
        failures: list[Exception] = []
        for peer in self._up_peers():
            wanted = [i for i, present in enumerate(found) if not present]
            for start in range(0, len(wanted), MAX_KEYS):
                batch = wanted[start:start + MAX_KEYS]
                try:
                    answers = peer.has([bytes.fromhex(names[i]) for i in batch])
                except Exception as exc:
                    failures.append(self._peer_failed(peer, exc))
                    break
                for i, present in zip(batch, answers):
                    if present:
                        found[i] = True
                        self._remember_holder(names[i], peer)
        if failures and len(failures) == len(self._peers):
            raise failures[-1]  # no peer could answer: counted, and the tier rests a moment
        return found

    def _get(self, name: str, max_bytes: int) -> bytes:
        # `max_bytes` is left to the peer client: it refuses any reply over the largest chunk.
        peer, _ = self._holders.get(name, (None, 0.0))
        if peer is None or time.monotonic() < peer.down_until:
            raise MissingChunk(name)
        try:
            chunk = peer.get(bytes.fromhex(name))
        except Exception as exc:
            raise self._peer_failed(peer, exc) from None
        if chunk is None:
            self._holders.pop(name, None)
            raise MissingChunk(name)  # evicted there since it said it had it
        return chunk

    def _up_peers(self) -> list[PeerClient]:
        now = time.monotonic()
        return [peer for peer in self._peers if now >= peer.down_until]

    def _remember_holder(self, name: str, peer: PeerClient) -> None:
        with self._lock:
            self._holders[name] = (peer, time.monotonic() + _FOUND_S)

    def _peer_failed(self, peer: PeerClient, exc: Exception) -> Exception:
        """Rest `peer` for a moment, count a refusal; the exception to raise."""
        peer.down_until = time.monotonic() + _PEER_DOWN_S
        if isinstance(exc, PeerRefused):
            code = exc.refusal.code
            if self.counts[f"refused_{code}"] == 0:
                logger.warning("p2p tier: peer %s refused us: %s", peer.address, exc)
            self.counts[f"refused_{code}"] += 1
            if self._refused is not None:
                self._refused.labels(self.context.name, code).inc()
        return exc

    # ---- stores: none ------------------------------------------------------------------------

    def _store(self, job: TransferJob) -> None:
        raise StoreSkipped(SKIP_REASON)

    def _put(self, key: ChunkKey, data: bytes) -> None:
        raise StoreSkipped(SKIP_REASON)

    def _delete(self, names: Sequence[str]) -> None:
        """Nothing: a damaged chunk from a peer is dropped here; the peer's memory is its own."""

    def shutdown(self) -> bool:
        stopped = super().shutdown()
        if self._server is not None:
            stopped = self._server.shutdown(self.options.timeout_s) and stopped
        for peer in self._peers:
            peer.close()
        if stopped:  # every socket closed: the context ends at once
            self._zmq.term()
        return stopped
