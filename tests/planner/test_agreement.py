"""The planner against a real replay: the same trace, sent one request at a time to an engine in
this process (kvtier bench trace) and simulated (kvtier plan), gives the same hits per tier."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch

from kvtier.config import EngineConfig
from kvtier.entrypoints.bench import EngineTarget
from kvtier.entrypoints.bench.trace import TraceScaling
from kvtier.entrypoints.bench.trace_runner import TraceReplayConfig, run_trace
from kvtier.offload.config import CONNECTOR_NAME, OffloadConfig, parse_kv_offload
from kvtier.planner.model_kv import model_kv
from kvtier.planner.plan import PlanConfig, run_plan
from kvtier.planner.simulator import SchedulerLimits

from ..tiny_models import make_hf_model

torch.set_num_threads(1)

TRACE = Path(__file__).parent / "data" / "agree_trace.jsonl"
BLOCK_SIZE = 4
# Requests 200 ms apart (the trace's are 10 ms): each one's tier stores end before the next
# arrives, as the planner's stores, which take no time without a cost model. Back to back, a
# chunk still on its way to the disk tier is held in host memory and another one is evicted
# in its place.
SCALING = TraceScaling(tokens_per_block=8, time_scale=20.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("model")
    make_hf_model("llama", directory)
    return str(directory)


def _offload_extra(kv_offload: str) -> dict:
    # The planner stores the chunks of prompts only (a trace names no output tokens), so the
    # engine does too: with a disk tier that loads straight from its file, a chunk output
    # tokens filled would take a host slot the plan keeps for a prompt's.
    return {**parse_kv_offload(kv_offload), "offload_prompt_only": True}


def _replay(model_dir: str, num_device_blocks: int, kv_offload: str | None) -> dict:
    transfer = None if kv_offload is None else {"kv_connector": CONNECTOR_NAME,
                                                "kv_connector_extra_config":
                                                    _offload_extra(kv_offload)}
    engine = EngineConfig.create(model=model_dir, dtype="float32", block_size=BLOCK_SIZE,
                                 num_device_blocks=num_device_blocks,
                                 kv_transfer_config=transfer)
    target = EngineTarget(engine, api="completions", request_timeout_s=60, run_timeout_s=120)
    config = TraceReplayConfig(TRACE, SCALING, max_concurrency=1)
    report = asyncio.run(run_trace(config, target, show_progress=False))
    assert report["num_failed"] == 0, report["errors"]
    return report["hit_rates"]


def _plan(model_dir: str, num_device_blocks: int, kv_offload: str | None) -> dict:
    model = model_kv(model_dir, BLOCK_SIZE, "float32")
    offload = (None if kv_offload is None
               else OffloadConfig.from_extra_config(_offload_extra(kv_offload)))
    # One at a time, as the replay sends them; no cost model: hits only.
    config = PlanConfig(TRACE, model, num_device_blocks * model.bytes_per_block, offload,
                        scaling=SCALING, limits=SchedulerLimits(max_num_seqs=1))
    return run_plan(config)


def test_device_cache_alone_agrees(model_dir):
    replayed = _replay(model_dir, 64, None)
    planned = _plan(model_dir, 64, None)
    # By hand: [0,1,2]+6 -> 24, [3,4] -> 16, [0,1,2] -> 20, [3,4,5] -> 20, [8,9] -> 12 (capped).
    assert planned["hit_tokens"] == {"device": 24 + 16 + 20 + 20 + 12}
    assert replayed["device"]["hits"] == planned["hit_tokens"]["device"]
    assert replayed["device"]["queries"] == planned["prompt_tokens"]


def test_small_device_with_host_tier_agrees_per_tier(model_dir):
    # 12 blocks (11 usable, 44 tokens): each prompt evicts most of the one before it, so the
    # host tier serves what the device lost.
    model = model_kv(model_dir, BLOCK_SIZE, "float32")
    kv_offload = f"host={64 * model.bytes_per_block}"
    replayed = _replay(model_dir, 12, kv_offload)
    planned = _plan(model_dir, 12, kv_offload)
    hits = planned["hit_tokens"]
    assert hits["device"] > 0 and hits["host"] > 0
    assert replayed["device"]["hits"] == hits["device"]
    # The engine counts host hits in chunks of one block.
    assert replayed["host"]["hits"] * BLOCK_SIZE == hits["host"]
    assert planned["hit_rate"]["total"] == pytest.approx(
        (hits["device"] + hits["host"]) / planned["prompt_tokens"])


def test_small_host_with_disk_tier_agrees_per_tier(model_dir, tmp_path):
    # Host memory of 10 blocks in front of a disk tier that holds everything: chunks the host
    # evicted come back from the disk.
    model = model_kv(model_dir, BLOCK_SIZE, "float32")
    disk_bytes = 4096 + 64 * (4096 + 4096)  # the disk file's header and 64 page-aligned slots
    kv_offload = f"host={10 * model.bytes_per_block},disk={tmp_path}:{disk_bytes}"
    replayed = _replay(model_dir, 12, kv_offload)
    planned = _plan(model_dir, 12, kv_offload)
    hits = planned["hit_tokens"]
    assert hits["device"] > 0 and hits["host"] > 0 and hits["disk"] > 0
    assert replayed["device"]["hits"] == hits["device"]
    assert replayed["host"]["hits"] * BLOCK_SIZE == hits["host"]
    assert replayed["disk"]["hits"] * BLOCK_SIZE == hits["disk"]


def test_chunks_of_two_blocks_agree_per_tier(model_dir, tmp_path):
    # Chunks of 2 blocks: a device hit can end inside a chunk, which then loads only its other
    # block; the tiers count chunk lookups.
    model = model_kv(model_dir, BLOCK_SIZE, "float32")
    chunk = 2 * model.bytes_per_block
    disk_bytes = 4096 + 64 * (4096 + 8192)  # header, then 64 slots of a page and a chunk
    kv_offload = (f"host={6 * chunk},disk={tmp_path}:{disk_bytes},blocks_per_chunk=2")
    replayed = _replay(model_dir, 12, kv_offload)
    planned = _plan(model_dir, 12, kv_offload)
    hits = planned["hit_tokens"]
    assert hits["device"] > 0 and hits["host"] > 0 and hits["disk"] > 0
    assert replayed["device"]["hits"] == hits["device"]
    # The engine counts chunks, the plan tokens. The disk's chunks load whole; the device hits
    # are 7 blocks in all, and one of them ends inside a chunk that host memory then loads
    # only the other block of.
    assert hits["device"] == 28
    assert replayed["disk"]["hits"] * 2 * BLOCK_SIZE == hits["disk"]
    assert replayed["host"]["hits"] * 2 * BLOCK_SIZE - BLOCK_SIZE == hits["host"]
