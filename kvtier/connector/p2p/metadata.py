"""P2PConnector options, the kv_transfer_params it reads and writes, and its step metadata."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from kvtier.common.options import require
from kvtier.connector.base import KVConnectorMetadata
from kvtier.transport.config import BACKENDS


@dataclass(frozen=True)
class P2PConnectorOptions:
    # Where this instance's transfer engine listens (a consumer's address goes to producers).
    bind_host: str = "127.0.0.1"
    port: int = 0
    # A producer's send of one request, handshake included, fails (and frees its blocks or its
    # host copy) after this long, e.g. when the consumer never asks for it.
    send_timeout_s: float = 60.0
    # A producer's connect to a consumer (the handshake) fails after this long; it runs in
    # the background, never inside the engine step.
    connect_timeout_s: float = 5.0
    # A consumer fails back a transfer's layers that no request of its own asked for within
    # this long (it refused the request, e.g. its queue was full, so the router sent it
    # elsewhere): the producer frees that prompt's blocks then rather than at its
    # send_timeout_s. A request that asks later computes its prompt itself.
    unclaimed_offer_timeout_s: float = 30.0
    # The transfer engine backend (kvtier.transport.BACKENDS); producer and consumer must agree.
    transport: str = "zmq"
    # "layer": a producer sends each layer's KV of the prompt's full blocks while the forward
    # pass that completes the prompt computes the next layers. "request": it sends every layer
    # once the request has finished. Consumers receive either the same way.
    push: Literal["layer", "request"] = "layer"

    def __post_init__(self) -> None:
        where = "P2PConnector extra config:"
        require(isinstance(self.bind_host, str) and bool(self.bind_host), where,
                "bind_host must be a host name or address", self.bind_host)
        require(type(self.port) is int and 0 <= self.port <= 65535, where,
                "port must be in 0..65535", self.port)
        require(isinstance(self.send_timeout_s, (int, float)) and self.send_timeout_s > 0,
                where, "send_timeout_s must be a number of seconds > 0", self.send_timeout_s)
        require(isinstance(self.connect_timeout_s, (int, float)) and self.connect_timeout_s > 0,
                where, "connect_timeout_s must be a number of seconds > 0",
                self.connect_timeout_s)
        require(isinstance(self.unclaimed_offer_timeout_s, (int, float))
                and self.unclaimed_offer_timeout_s > 0, where,
                "unclaimed_offer_timeout_s must be a number of seconds > 0",
                self.unclaimed_offer_timeout_s)
        require(self.transport in BACKENDS, where, f"transport must be one of {BACKENDS}",
                self.transport)
        require(self.push in ("layer", "request"), where, 'push must be "layer" or "request"',
                self.push)


@dataclass(frozen=True)
class SendParams:
    """A producer request's kv_transfer_params: send its prompt's KV to `consumer_address`."""

    transfer_id: str
    consumer_address: str

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> SendParams | None:
        if not params or not {"transfer_id", "consumer_address"} <= params.keys():
            return None
        if not all(isinstance(params[k], str) and params[k]
                   for k in ("transfer_id", "consumer_address")):
            raise ValueError("kv_transfer_params: transfer_id and consumer_address must be "
                             f"non-empty strings, got {params!r}")
        return cls(params["transfer_id"], params["consumer_address"])


@dataclass(frozen=True)
class LoadParams:
    """A consumer request's kv_transfer_params, as the producer returned them: the transfer
    that carries the KV of the prompt's first `num_tokens` tokens, and the hash of the last of
    those blocks as the producer computed it, "ALGO:HEX" (it chains over the tokens and whatever
    else shaped the KV: a LoRA adapter, a cache_salt), which the consumer's own hash must equal
    when it hashes the same way."""

    transfer_id: str
    num_tokens: int
    block_hash: str | None = None
    # The producer's KV namespace (hex, KVIdentity.namespace): KV stored another way (another
    # model, dtype, KV cache dtype or block size) that the consumer must not load.
    kv_namespace: str | None = None

    @classmethod
    def parse(cls, params: dict[str, Any] | None) -> LoadParams | None:
        if not params or not {"transfer_id", "num_tokens"} <= params.keys():
            return None
        if not (isinstance(params["transfer_id"], str) and type(params["num_tokens"]) is int
                and params["num_tokens"] >= 0):
            raise ValueError("kv_transfer_params: transfer_id must be a string and num_tokens "
                             f"a count >= 0, got {params!r}")
        for key in ("block_hash", "kv_namespace"):
            if params.get(key) is not None and not isinstance(params[key], str):
                raise ValueError(f"kv_transfer_params: {key} must be a hex string, got "
                                 f"{params[key]!r}")
        return cls(params["transfer_id"], params["num_tokens"], params.get("block_hash"),
                   params.get("kv_namespace"))


@dataclass(frozen=True)
class BlockSend:
    req_id: str
    transfer_id: str
    consumer_address: str
    # The request's first blocks, in order.
    block_ids: list[int]


@dataclass(frozen=True)
class LayerPush:
    """This step's part of a producer request's layer-wise push: as each layer is computed, copy
    its blocks `block_ids` (the prompt's blocks first_block...) to the host, and once the last
    of the prompt's `num_blocks` full blocks is copied (`is_last`), send the layer."""

    req_id: str
    transfer_id: str
    consumer_address: str
    num_blocks: int
    first_block: int
    block_ids: list[int]

    @property
    def is_last(self) -> bool:
        return self.first_block + len(self.block_ids) == self.num_blocks


@dataclass(frozen=True)
class BlockLoad:
    req_id: str
    transfer_id: str
    # Blocks the producer sends (all its prompt's full blocks).
    num_remote_blocks: int
    # block_ids[i] receives remote block first_block + i; none when the request found all of
    # it locally and the transfer is only taken to release the producer.
    first_block: int
    block_ids: list[int]

    @property
    def is_drain(self) -> bool:
        return not self.block_ids


@dataclass
class P2PConnectorMetadata(KVConnectorMetadata):
    sends: list[BlockSend] = field(default_factory=list)
    loads: list[BlockLoad] = field(default_factory=list)
    pushes: list[LayerPush] = field(default_factory=list)
    # Requests whose layer-wise push ended before the prompt was computed (aborted): their
    # host copies are dropped unsent.
    dropped_pushes: list[str] = field(default_factory=list)
