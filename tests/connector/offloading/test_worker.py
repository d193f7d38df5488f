"""The offloading worker half on its own: built from the context it is handed (the host area
made by create_shared), driven by metadata alone, answering with its typed report."""

import dataclasses
import time

import numpy as np
import pytest
import torch

from kvtier.connector import ConnectorContext, KVConnectorRole, KVTransferConfig
from kvtier.connector.offloading import OffloadingConnector, OffloadingConnectorWorker
from kvtier.connector.offloading.metadata import (
    ChunkTransfer,
    OffloadingConnectorMetadata,
    OffloadingConnectorReport,
)
from kvtier.kv import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVIdentity

BLOCK, HEADS, HEAD_DIM, NUM_BLOCKS = 4, 2, 3, 8
IDENTITY = KVIdentity("worker-test", "test-weights", "float32", BLOCK, "test-layout",
                      ("full_attention",))
LAYERS = ["model.layers.0.self_attn", "model.layers.1.self_attn"]
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=HEADS, head_size=HEAD_DIM, dtype_size=4)
KV_CONFIG = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_groups=[KVCacheGroupSpec(LAYERS, SPEC)])
CONFIG = KVTransferConfig.from_dict({
    "kv_connector": "OffloadingConnector", "kv_load_timeout_s": 5,
    "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
                                  "cpu_bytes_to_use": 4 * 2 * SPEC.page_size_bytes}})


def _context():
    context = ConnectorContext(block_size=BLOCK, num_layers=2, kv_identity=IDENTITY,
                               kv_cache_config=KV_CONFIG)
    return dataclasses.replace(context, shared=OffloadingConnector.create_shared(CONFIG, context))


def _worker(context, caches):
    worker = OffloadingConnector.create(KVConnectorRole.WORKER, CONFIG, context)
    assert isinstance(worker, OffloadingConnectorWorker)
    worker.register_kv_caches(caches)
    return worker


def _caches(seed):
    generator = torch.Generator().manual_seed(seed)
    return {name: torch.randn(2, NUM_BLOCKS, BLOCK, HEADS, HEAD_DIM, generator=generator)
            for name in LAYERS}


def _step(worker, metadata):
    """One step of the runner's hook sequence: (finished_recving, load errors, batches)."""
    worker.bind_connector_metadata(metadata)
    worker.start_load_kv(None)
    worker.wait_for_save()
    _, recving = worker.get_finished(set())
    errors = worker.get_block_ids_with_load_errors()
    report = worker.build_connector_report()
    worker.clear_connector_metadata()
    assert report is None or isinstance(report, OffloadingConnectorReport)
    return recving, errors, [] if report is None else report.batches


def _run(worker, metadata, num_batches, timeout_s=10.0):
    """A step with `metadata`, then empty steps until `num_batches` copy batches were
    reported; what every step reported, together."""
    recving, errors, batches = _step(worker, metadata)
    deadline = time.monotonic() + timeout_s
    while len(batches) < num_batches:
        assert time.monotonic() < deadline, "the copy thread never reported"
        time.sleep(0.002)
        more = _step(worker, OffloadingConnectorMetadata())
        recving, errors, batches = recving | more[0], errors | more[1], batches + more[2]
    return recving, errors, batches


def _page(area, layout, slot, block_in_chunk, layer):
    start = slot * area.slot_bytes + layout.page_offset(block_in_chunk, layer)
    return area.buffer[start:start + layout.page_bytes].view(np.float32)


def test_store_lands_in_the_host_slot_and_comes_back_in_the_report():
    context = _context()
    area, (layout,) = context.shared.area, context.shared.layouts
    caches = _caches(seed=1)
    worker = _worker(context, caches)
    try:
        store = ChunkTransfer(job_id=7, req_id="r", group_id=0, slot=2, block_offsets=(0,),
                              block_ids=(5,))
        recving, errors, batches = _run(worker, OffloadingConnectorMetadata(stores=[store]), 1)
        assert (recving, errors) == (set(), set())
        assert [(b.direction, b.job_ids, b.ok, b.num_bytes) for b in batches] == [
            ("device_to_host", (7,), True, layout.block_bytes)]
        for index, name in enumerate(LAYERS):
            # one page: K then V of block 5, each (block_size, kv_heads, head_dim)
            expected = caches[name][:, 5].numpy().reshape(-1)
            assert np.array_equal(_page(area, layout, 2, 0, index), expected)
        assert not area.buffer[:2 * area.slot_bytes].any()  # other slots untouched
    finally:
        worker.shutdown()


def test_load_fills_the_device_block_before_the_forward_and_reports_lost_chunks():
    context = _context()
    source = _caches(seed=2)
    first = _worker(context, source)
    _step(first, OffloadingConnectorMetadata(stores=[ChunkTransfer(1, "a", 0, 0, (0,), (3,))]))
    first.shutdown()  # waits for its queued copy
    assert first.build_connector_report().batches[0].ok
    target = {name: torch.zeros_like(cache) for name, cache in source.items()}
    worker = _worker(context, target)  # a second worker on the same area finds the bytes
    try:
        load = ChunkTransfer(2, "b", 0, 0, (0,), (6,))
        lost = ChunkTransfer(3, "c", 0, None, (0,), (4,))  # its chunk left host memory
        worker.bind_connector_metadata(OffloadingConnectorMetadata(loads=[load, lost]))
        worker.start_load_kv(None)
        for name in LAYERS:  # copied by the time the forward could read it
            assert torch.equal(target[name][:, 6], source[name][:, 3])
            assert not target[name][:, :6].any()
        worker.wait_for_save()
        assert worker.get_finished(set()) == (set(), set())  # nothing asynchronous
        assert worker.get_block_ids_with_load_errors() == {4}
        report = worker.build_connector_report()
        assert [(b.direction, b.job_ids, b.ok) for b in report.batches] == [
            ("host_to_device", (2,), True)]
    finally:
        worker.clear_connector_metadata()
        worker.shutdown()


def test_a_half_without_the_shared_area_says_how_to_make_it():
    context = ConnectorContext(block_size=BLOCK, num_layers=2, kv_identity=IDENTITY,
                               kv_cache_config=KV_CONFIG)
    with pytest.raises(ValueError, match=r"OffloadingConnector\.create_shared\(config, "
                                         r"context\)"):
        OffloadingConnector.create(KVConnectorRole.WORKER, CONFIG, context)
    with pytest.raises(ValueError, match=r"OffloadingConnector\.create_shared"):
        OffloadingConnector.create(KVConnectorRole.SCHEDULER, CONFIG, context)


def test_shared_area_slots_fit_the_largest_group():
    small = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=HEAD_DIM, dtype_size=4)
    config = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_groups=[
        KVCacheGroupSpec(LAYERS[:1], small), KVCacheGroupSpec(LAYERS, SPEC)])
    context = ConnectorContext(block_size=BLOCK, num_layers=3, kv_identity=IDENTITY,
                               kv_cache_config=config)
    shared = OffloadingConnector.create_shared(CONFIG, context)
    assert [layout.chunk_bytes for layout in shared.layouts] == [
        small.page_size_bytes, 2 * SPEC.page_size_bytes]
    assert shared.area.slot_bytes == 2 * SPEC.page_size_bytes
    assert shared.area.num_slots == 4
