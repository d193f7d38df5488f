"""P2PConnector's scheduler half: which blocks a producer sends, which a consumer loads."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvtier.connector.base import ConnectorContext, KVConnectorScheduler
from kvtier.connector.config import KVTransferConfig, parse_options
from kvtier.connector.p2p.metadata import (
    BlockLoad,
    BlockSend,
    LayerPush,
    LoadParams,
    P2PConnectorMetadata,
    P2PConnectorOptions,
    SendParams,
)

if TYPE_CHECKING:
    from kvtier.kv import KVCacheBlocks, Request

logger = logging.getLogger(__name__)


@dataclass
class _Push:
    """A producer request pushed layer by layer: its block ids and how far it was copied."""

    params: SendParams
    num_blocks: int
    block_ids: list[int] = field(default_factory=list)
    num_copied: int = 0


class P2PConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, context: ConnectorContext) -> None:
        super().__init__(config, context)
        context.require_one_kv_cache_group("P2PConnector")
        self._layer_push = parse_options(P2PConnectorOptions, config.kv_connector_extra_config,
                                         "P2PConnector extra config").push == "layer"
        self._pushes: dict[str, _Push] = {}
        self._dropped: list[str] = []
        self._sends: list[BlockSend] = []
        self._drains: list[BlockLoad] = []
        # request id -> (request, its transfer, its block ids, blocks to load), set at
        # allocation.
        self._pending_loads: dict[str, tuple[Request, LoadParams, list[int], int]] = {}
        # Requests allocated blocks once, which took their transfer then (to load it or drop
        # it) if they had one: a request resumes after its load and asks again.
        self._taken: set[str] = set()

    def _params(self, parse, request: Request) -> Any:
        try:
            return parse(request.kv_transfer_params)
        except ValueError as exc:
            # Checked where the request entered; a bad dict here costs its transfer only.
            logger.warning("request %s: %s; no KV transfer for it", request.request_id, exc)
            return None

    def _load_params(self, request: Request) -> LoadParams | None:
        """A consumer request's transfer, or None. The client supplies its num_tokens, which
        sizes the load's host buffer: more than the prompt is refused (the producer never sends
        that many), costing that request its transfer and no other request anything."""
        params = self._params(LoadParams.parse, request) if self.config.is_consumer else None
        if params is not None and params.num_tokens > request.num_prompt_tokens:
            logger.warning("request %s: kv_transfer_params num_tokens %d exceeds its %d prompt "
                           "tokens; no KV transfer for it", request.request_id,
                           params.num_tokens, request.num_prompt_tokens)
            return None
        return params

    def _same_prefix(self, request: Request, params: LoadParams) -> bool:
        """Whether the producer's last sent block is this request's block there. A producer
        that hashes blocks another way ("ALGO:HEX" names its algorithm) is not checked."""
        num_blocks = params.num_tokens // self.context.block_size
        algo, _, digest = (params.block_hash or "").rpartition(":")
        if not digest or num_blocks == 0 or algo != self.context.hash_algo:
            return True
        hashes = request.block_hashes
        return len(hashes) >= num_blocks and hashes[num_blocks - 1].hex() == digest

    def _same_namespace(self, params: LoadParams) -> bool:
        """Whether the producer stores KV as this engine does (a producer that does not say is
        taken at its word: the transport's handshake still checks)."""
        return params.kv_namespace in (None, self.context.namespace.hex())

    def get_num_new_matched_tokens(self, request: Request,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        params = self._load_params(request)
        if params is None or request.request_id in self._pending_loads \
                or request.request_id in self._taken or not self._same_prefix(request, params) \
                or not self._same_namespace(params):
            return 0, False
        block_size = self.context.block_size
        # The last token is always computed here: the model needs its logits to sample.
        usable = min(params.num_tokens, (request.num_tokens - 1) // block_size * block_size)
        num_new = max(0, usable - num_computed_tokens)
        return num_new, num_new > 0

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if self._layer_push and self.config.is_producer:
            self._start_push(request, blocks)
        if request.request_id in self._taken:
            return
        self._taken.add(request.request_id)
        if num_external_tokens <= 0:
            params = self._load_params(request)
            if params is not None and params.num_tokens > 0:
                if not self._same_namespace(params):
                    # Its producer's handshake with this engine is refused: nothing to drop.
                    logger.warning("request %s: the producer stores KV another way (another "
                                   "model, dtype, KV cache dtype or block size: its KV "
                                   "namespace differs); no transfer, the prompt computed here",
                                   request.request_id)
                    return
                if not self._same_prefix(request, params):
                    logger.warning("request %s: the producer computed another prefix (another "
                                   "LoRA adapter, cache_salt or prompt: its block hash "
                                   "differs); its KV is dropped, the prompt computed here",
                                   request.request_id)
                # Nothing to load (all of it hit locally, or not this request's KV).
                self._drop_transfer(request, params)
            return
        self._pending_loads[request.request_id] = (
            request, self._load_params(request), list(blocks.get_block_ids()[0]),
            num_external_tokens // self.context.block_size)

    def _drop_transfer(self, request: Request, params: LoadParams) -> None:
        """Take the transfer and drop it: its producer holds the prompt's blocks until its
        send ends, which without a taker is at its send_timeout_s."""
        self._drains.append(BlockLoad(request.request_id, params.transfer_id,
                                      params.num_tokens // self.context.block_size, 0, []))

    def _start_push(self, request: Request, blocks: KVCacheBlocks) -> None:
        params = self._params(SendParams.parse, request)
        num_blocks = request.num_prompt_tokens // self.context.block_size
        # A request resumed after preemption keeps its host copies: only its block ids change.
        if params is None or num_blocks == 0 or request.request_id in self._pushes:
            return
        self._pushes[request.request_id] = _Push(params, num_blocks)

    def build_connector_meta(self, scheduler_output: Any) -> P2PConnectorMetadata:
        meta = P2PConnectorMetadata(sends=self._sends, loads=self._drains,
                                    pushes=self._plan_pushes(scheduler_output),
                                    dropped_pushes=self._dropped)
        self._sends, self._drains, self._dropped = [], [], []
        for req_id, (request, params, block_ids, num_blocks) in self._pending_loads.items():
            # The scheduler has set num_computed_tokens to local hit + external tokens.
            end = request.num_computed_tokens // self.context.block_size
            meta.loads.append(BlockLoad(req_id, params.transfer_id,
                                        params.num_tokens // self.context.block_size,
                                        end - num_blocks, block_ids[end - num_blocks:end]))
        self._pending_loads.clear()
        return meta

    def _plan_pushes(self, scheduler_output: Any) -> list[LayerPush]:
        """The blocks of pushed requests that this step fills, for the worker to copy (and,
        with the prompt's last block, send) as each layer is computed."""
        for new_req in scheduler_output.scheduled_new_reqs:
            if new_req.req_id in self._pushes:
                self._pushes[new_req.req_id].block_ids = list(new_req.block_ids[0])
        for cached_req in scheduler_output.scheduled_cached_reqs:
            if cached_req.req_id in self._pushes:
                self._pushes[cached_req.req_id].block_ids.extend(cached_req.new_block_ids[0])
        pushes = []
        for data in [*scheduler_output.scheduled_new_reqs,
                     *scheduler_output.scheduled_cached_reqs]:
            push = self._pushes.get(data.req_id)
            if push is None:
                continue
            num_computed = (data.num_computed_tokens
                            + scheduler_output.num_scheduled_tokens[data.req_id])
            end = min(push.num_blocks, num_computed // self.context.block_size)
            if end > push.num_copied:
                # A local prefix hit's blocks go with the first chunk: the forward does not
                # write them, but their KV is in the paged cache already.
                pushes.append(LayerPush(data.req_id, push.params.transfer_id,
                                        push.params.consumer_address, push.num_blocks,
                                        push.num_copied, push.block_ids[push.num_copied:end]))
                push.num_copied = end
        return pushes

    def request_finished(self, request: Request,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._pending_loads.pop(request.request_id, None)
        if request.request_id not in self._taken:
            # Finished before it was allocated (aborted while it waited): drop its transfer
            # at the next step.
            params = self._load_params(request)
            if params is not None and params.num_tokens > 0:
                self._drop_transfer(request, params)
        self._taken.discard(request.request_id)
        push = self._pushes.pop(request.request_id, None)
        if push is not None:
            return self._finish_push(request, push)
        params = self._params(SendParams.parse, request) if self.config.is_producer else None
        if params is None:
            return False, None
        if self._layer_push:
            # A prompt shorter than one block: there was nothing to push.
            return False, {"transfer_id": params.transfer_id, "num_tokens": 0}
        # Only blocks whose KV was computed: an aborted prefill leaves the rest unwritten.
        num_computed = min(request.num_prompt_tokens, request.num_computed_tokens)
        num_blocks = min(len(block_ids), num_computed // self.context.block_size)
        result = _load_params_for(request, params.transfer_id, num_blocks, self.context)
        if num_blocks == 0:
            return False, result
        # The worker sends from these blocks: they stay allocated until it reports the send.
        self._sends.append(BlockSend(request.request_id, params.transfer_id,
                                     params.consumer_address, list(block_ids[:num_blocks])))
        return True, result

    def _finish_push(self, request: Request, push: _Push) -> tuple[bool, dict[str, Any]]:
        """A layer-wise push's (delay_free, kv_transfer_params). Its KV is on the host already,
        but its blocks stay allocated until its sends end: the engine keeps stepping only while
        a finished request holds blocks, and those steps collect the sends' results."""
        req_id = request.request_id
        if push.num_copied == push.num_blocks:
            return True, _load_params_for(request, push.params.transfer_id, push.num_blocks,
                                          self.context)
        # The prompt was not computed to its end (aborted): nothing was sent.
        if push.num_copied > 0:
            self._dropped.append(req_id)
        return False, {"transfer_id": push.params.transfer_id, "num_tokens": 0}


def _load_params_for(request: Request, transfer_id: str, num_blocks: int,
                     context: ConnectorContext) -> dict[str, Any]:
    """The kv_transfer_params a producer returns for a transfer of the prompt's first
    `num_blocks` blocks (LoadParams, the consumer's side)."""
    params: dict[str, Any] = {"transfer_id": transfer_id,
                              "num_tokens": num_blocks * context.block_size}
    if num_blocks > 0:
        digest = request.block_hashes[num_blocks - 1].hex()
        params["block_hash"] = f"{context.hash_algo}:{digest}"
        params["kv_namespace"] = context.namespace.hex()
    return params
