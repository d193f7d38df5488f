"""Helpers for the connector tests: real requests, real tensors, scheduler-shaped data."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvtier.connector import ConnectorContext, KVConnectorWorker
from kvtier.kv.hashing import KVIdentity, make_block_hasher
from kvtier.kv.request import Request
from kvtier.sampling_params import SamplingParams
from kvtier.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

BLOCK_SIZE = 4
MAX_TOKENS = 6  # generated per prompt by the end-to-end tests
NUM_LAYERS = 2
NUM_BLOCKS = 8
LAYER_NAMES = [f"model.layers.{i}.self_attn" for i in range(NUM_LAYERS)]
IDENTITY = KVIdentity("test-model", "test-weights", "float32", BLOCK_SIZE, "test-layout",
                      ("full_attention",))
CONTEXT = ConnectorContext(block_size=BLOCK_SIZE, num_layers=NUM_LAYERS, kv_identity=IDENTITY)
# The out-of-tree test connectors, as kv_connector_module_path names them.
PLUGINS = "tests.connector.kvtier_test_connectors"


@dataclass
class AllocatedBlocks:
    """What `update_state_after_alloc` receives: one list of block ids per KV cache group."""

    block_ids: list[int]

    def get_block_ids(self) -> tuple[list[int], ...]:
        return (self.block_ids,)


def make_request(request_id: str, num_tokens: int, first_token: int = 0) -> Request:
    return Request(request_id, list(range(first_token, first_token + num_tokens)),
                   SamplingParams(max_tokens=1), block_hasher=make_block_hasher(BLOCK_SIZE))


def make_kv_caches(seed: int | None) -> dict[str, torch.Tensor]:
    """Per layer (2, num_blocks, block_size, kv_heads, head_dim); zeros when seed is None."""
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, 2, 3)
    if seed is None:
        return {name: torch.zeros(shape) for name in LAYER_NAMES}
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=generator) for name in LAYER_NAMES}


def prefill_output(request: Request, block_ids: list[int], num_computed: int = 0,
                   num_scheduled: int | None = None) -> SchedulerOutput:
    """A step that schedules `request` for the first time."""
    num_scheduled = request.num_tokens - num_computed if num_scheduled is None else num_scheduled
    new_req = NewRequestData(request.request_id, list(request.all_token_ids),
                             request.num_prompt_tokens, request.sampling_params,
                             (list(block_ids),), num_computed)
    return SchedulerOutput([new_req], [], {request.request_id: num_scheduled}, num_scheduled)


def decode_output(request_id: str, new_block_ids: list[int], num_computed: int,
                  num_scheduled: int = 1) -> SchedulerOutput:
    cached = CachedRequestData(request_id, (list(new_block_ids),), num_computed)
    return SchedulerOutput([], [cached], {request_id: num_scheduled}, num_scheduled)


def empty_output() -> SchedulerOutput:
    return SchedulerOutput([], [], {}, 0)


def wait_finished_recving(worker: KVConnectorWorker, req_id: str,
                          timeout_s: float = 10.0) -> set[int]:
    """Poll like the runner does each step until `req_id` is received; its invalid block ids."""
    deadline = time.monotonic() + timeout_s
    invalid: set[int] = set()
    while time.monotonic() < deadline:
        _, recving = worker.get_finished(set())
        invalid |= worker.get_block_ids_with_load_errors()
        if req_id in recving:
            return invalid
        time.sleep(0.005)
    raise TimeoutError(f"{req_id} not reported in finished_recving within {timeout_s} s")
