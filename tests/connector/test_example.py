"""ExampleConnector on real tensors: both halves driven step by step as the engine drives them."""

import json
import os
import pickle
from dataclasses import replace

import pytest
import torch

from kvtier import LLM
from kvtier.connector import KVConnectorRole, KVTransferConfig, create_connector
from kvtier.connector.example import BlockFiles, BlockTransfer
from kvtier.kv.hashing import make_block_hasher
from kvtier.kv.request import Request
from kvtier.offload.chunk_format import read_chunk_into, write_chunk

from ..tiny_models import make_lfm2_model
from .connector_testing import (
    CONTEXT,
    IDENTITY,
    AllocatedBlocks,
    decode_output,
    empty_output,
    make_kv_caches,
    make_request,
    prefill_output,
    wait_finished_recving,
)


def make_halves(path, context=CONTEXT, **config_fields):
    config = KVTransferConfig("ExampleConnector",
                              kv_connector_extra_config={"shared_storage_path": str(path)},
                              **config_fields)
    return (create_connector(config, KVConnectorRole.SCHEDULER, context),
            create_connector(config, KVConnectorRole.WORKER, context))


def run_step(worker, meta):
    """The worker hooks around one forward pass (the forward itself writes nothing here)."""
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()


def save_prompt(path, request, block_ids, caches):
    """Process A: prefill `request` in one step and save its full blocks; returns the saves."""
    scheduler, worker = make_halves(path)
    worker.register_kv_caches(caches)
    scheduler.update_state_after_alloc(request, AllocatedBlocks(block_ids), 0)
    meta = scheduler.build_connector_meta(prefill_output(request, block_ids))
    run_step(worker, meta)
    worker.shutdown()  # waits for the writes
    return meta.saves


def start_load(path, request, block_ids, num_local_tokens=0, context=CONTEXT,
               after_lookup=lambda: None, **config_fields):
    """Process B: the scheduler's async load path up to the worker starting the load."""
    scheduler, worker = make_halves(path, context, **config_fields)
    caches = make_kv_caches(seed=None)
    worker.register_kv_caches(caches)
    num_external, is_async = scheduler.get_num_new_matched_tokens(request, num_local_tokens)
    after_lookup()
    scheduler.update_state_after_alloc(request, AllocatedBlocks(block_ids), num_external)
    request.num_computed_tokens = num_local_tokens + num_external
    meta = scheduler.build_connector_meta(empty_output())
    run_step(worker, meta)
    return worker, caches, meta, (num_external, is_async)


def test_save_then_load_into_other_blocks_is_byte_exact(tmp_path):
    request_a = make_request("a", num_tokens=10)
    caches_a = make_kv_caches(seed=0)
    saves = save_prompt(tmp_path, request_a, [1, 2, 3], caches_a)
    assert saves == [BlockTransfer(1, request_a.block_hashes[0]),
                     BlockTransfer(2, request_a.block_hashes[1])]

    request_b = make_request("b", num_tokens=10)
    worker, caches_b, meta, matched = start_load(tmp_path, request_b, [5, 6, 7])
    assert matched == (8, True)
    assert meta.loads == {"b": [BlockTransfer(5, request_b.block_hashes[0]),
                                BlockTransfer(6, request_b.block_hashes[1])]}
    assert meta.saves == []
    assert wait_finished_recving(worker, "b") == set()
    for name, cache in caches_b.items():
        assert torch.equal(cache[:, 5], caches_a[name][:, 1])
        assert torch.equal(cache[:, 6], caches_a[name][:, 2])
        assert torch.count_nonzero(cache[:, [0, 1, 2, 3, 4, 7]]) == 0
    assert worker.get_stats() == {"example_connector_blocks_loaded": 2}
    worker.shutdown()


def test_block_files_are_content_addressed_in_the_namespace(tmp_path):
    request = make_request("a", num_tokens=9)
    save_prompt(tmp_path, request, [1, 2, 3], make_kv_caches(seed=0))
    files = BlockFiles(str(tmp_path), CONTEXT.namespace)
    assert files.directory == os.path.join(str(tmp_path), CONTEXT.namespace.hex())
    assert sorted(os.listdir(files.directory)) == sorted(
        [h.hex() + ".kv" for h in request.block_hashes] + [CONTEXT.namespace.hex() + ".json"])
    other_weights = replace(CONTEXT, kv_identity=replace(IDENTITY, weights_digest="other"))
    _, _, _, matched = start_load(tmp_path, make_request("b", 9), [1, 2, 3],
                                  context=other_weights)
    assert matched == (0, False)


def test_the_namespace_directory_describes_what_it_covers(tmp_path):
    save_prompt(tmp_path, make_request("a", num_tokens=5), [1, 2], make_kv_caches(seed=0))
    path = os.path.join(BlockFiles(str(tmp_path), CONTEXT.namespace).directory,
                        CONTEXT.namespace.hex() + ".json")
    with open(path) as f:
        assert json.load(f) == {**IDENTITY.describe(), "format": "KVTC/1"}
    assert IDENTITY.describe()["namespace"] == CONTEXT.namespace.hex()


def test_lookup_keeps_the_last_token_and_starts_after_the_local_hit(tmp_path):
    saved = make_request("a", num_tokens=13)  # three full blocks saved
    save_prompt(tmp_path, saved, [1, 2, 3, 4], make_kv_caches(seed=0))
    scheduler, worker = make_halves(tmp_path)
    # 12 tokens = 3 full blocks, but the last token must be computed: only 2 blocks offered.
    assert scheduler.get_num_new_matched_tokens(make_request("b", 12), 0) == (8, True)
    assert scheduler.get_num_new_matched_tokens(make_request("c", 13), 4) == (8, True)
    assert scheduler.get_num_new_matched_tokens(make_request("d", 13), 12) == (0, False)
    # Same first block, different second block: the chained hash stops the match at block 0.
    diverging = Request("e", [0, 1, 2, 3] + [99] * 9, block_hasher=make_block_hasher(4))
    assert scheduler.get_num_new_matched_tokens(diverging, 0) == (4, True)
    assert scheduler.get_num_new_matched_tokens(
        make_request("f", 13, first_token=1), 0) == (0, False)
    worker.shutdown()


def test_partial_load_keeps_going_and_reports_bad_blocks(tmp_path):
    request = make_request("a", num_tokens=13)
    caches_a = make_kv_caches(seed=0)
    save_prompt(tmp_path, request, [1, 2, 3, 4], caches_a)
    files = BlockFiles(str(tmp_path), CONTEXT.namespace)
    with open(files.path(request.block_hashes[1]), "wb") as corrupt:
        corrupt.write(b"not a tensor")
    # Deleted between lookup and load: a miss the worker must report, not crash on.
    worker, caches_b, meta, matched = start_load(
        tmp_path, make_request("b", num_tokens=13), [4, 5, 6, 7],
        after_lookup=lambda: os.remove(files.path(request.block_hashes[2])))
    assert matched == (12, True)
    assert wait_finished_recving(worker, "b") == {5, 6}
    for name, cache in caches_b.items():
        assert torch.equal(cache[:, 4], caches_a[name][:, 1])
    assert worker.get_stats() == {"example_connector_blocks_loaded": 1,
                                  "example_connector_load_errors": 2}
    worker.shutdown()


def _damage(files, block_hashes, how):
    path = files.path(block_hashes[0])
    if how == "flip_payload":
        with open(path, "r+b") as f:
            f.seek(-3, os.SEEK_END)
            byte = f.read(1)[0]
            f.seek(-3, os.SEEK_END)
            f.write(bytes([byte ^ 0x01]))
    elif how == "truncate":
        os.truncate(path, os.path.getsize(path) - 1)
    elif how == "other_block":  # a whole, valid file of another block under this one's name
        os.replace(files.path(block_hashes[1]), path)
    elif how == "other_size":  # this block's key, a payload of another layout
        with open(path, "wb") as f:
            write_chunk(f, files.key(block_hashes[0]), memoryview(bytes(64)))
    else:  # a pickle, as this connector once wrote: never unpickled, only refused
        with open(path, "wb") as f:
            pickle.dump({"model.layers.0.self_attn": [0.0] * 8}, f)


@pytest.mark.parametrize("how", ["flip_payload", "truncate", "other_block", "other_size",
                                 "pickle"])
def test_a_damaged_or_foreign_file_is_a_counted_load_error(tmp_path, how):
    request = make_request("a", num_tokens=9)
    save_prompt(tmp_path, request, [1, 2, 3], make_kv_caches(seed=0))
    _damage(BlockFiles(str(tmp_path), CONTEXT.namespace), request.block_hashes, how)
    num_good = 0 if how == "other_block" else 1  # other_block moved the second file away
    worker, caches_b, _, matched = start_load(tmp_path, make_request("b", 9), [4, 5, 6])
    assert matched == (4 + 4 * num_good, True)
    assert wait_finished_recving(worker, "b") == {4}
    assert all(torch.count_nonzero(cache[:, 4]) == 0 for cache in caches_b.values())
    # Dropped, so that the next save of the block writes a good copy.
    assert not os.path.exists(BlockFiles(str(tmp_path), CONTEXT.namespace)
                              .path(request.block_hashes[0]))
    expected = {"example_connector_load_errors": 1}
    if num_good:
        expected["example_connector_blocks_loaded"] = 1
    assert worker.get_stats() == expected
    worker.shutdown()


def test_a_load_past_its_deadline_fails_every_block(tmp_path):
    request = make_request("a", num_tokens=9)
    save_prompt(tmp_path, request, [1, 2, 3], make_kv_caches(seed=0))
    worker, caches_b, _, _ = start_load(tmp_path, make_request("b", 9), [4, 5, 6],
                                        kv_load_timeout_s=1e-9)
    assert wait_finished_recving(worker, "b") == {4, 5}
    assert all(torch.count_nonzero(cache) == 0 for cache in caches_b.values())
    worker.shutdown()


def test_decode_saves_each_block_once_when_it_fills(tmp_path):
    scheduler, worker = make_halves(tmp_path)
    caches = make_kv_caches(seed=1)
    worker.register_kv_caches(caches)
    request = make_request("a", num_tokens=6)
    scheduler.update_state_after_alloc(request, AllocatedBlocks([3, 4]), 0)
    meta = scheduler.build_connector_meta(prefill_output(request, [3, 4]))
    assert meta.saves == [BlockTransfer(3, request.block_hashes[0])]
    run_step(worker, meta)
    request.append_output_token_ids([100, 101])  # block 1 (tokens 4..7) is now known
    meta = scheduler.build_connector_meta(decode_output("a", [], num_computed=6))
    assert meta.saves == []  # token 7 is not computed yet
    request.append_output_token_ids(102)
    meta = scheduler.build_connector_meta(decode_output("a", [5], num_computed=7))
    assert meta.saves == [BlockTransfer(4, request.block_hashes[1])]
    run_step(worker, meta)
    worker.shutdown()
    files = BlockFiles(str(tmp_path), CONTEXT.namespace)
    block = torch.cat([cache[:, 4].reshape(-1).view(torch.uint8) for cache in caches.values()])
    stored = bytearray(block.numel())
    with open(files.path(request.block_hashes[1]), "rb") as f:
        read_chunk_into(f, files.key(request.block_hashes[1]), memoryview(stored))
    assert stored == block.numpy().tobytes()


@pytest.mark.parametrize("role, saves, matched", [("kv_producer", 1, (0, False)),
                                                  ("kv_consumer", 0, (4, True))])
def test_role_limits_the_direction(tmp_path, role, saves, matched):
    save_prompt(tmp_path, make_request("a", num_tokens=5), [1, 2], make_kv_caches(seed=0))
    scheduler, worker = make_halves(tmp_path, kv_role=role)
    request = make_request("b", num_tokens=9, first_token=50)
    scheduler.update_state_after_alloc(request, AllocatedBlocks([3, 4, 5]), 0)
    assert len(scheduler.build_connector_meta(prefill_output(request, [3, 4, 5])).saves) == \
        2 * saves
    assert scheduler.get_num_new_matched_tokens(make_request("c", 5), 0) == matched
    worker.shutdown()


@pytest.mark.parametrize("connector, extra", [
    ("ExampleConnector", {"shared_storage_path": "STORE"}), ("P2PConnector", {})])
def test_a_model_with_several_kv_cache_groups_is_refused_at_start(tmp_path, connector, extra):
    """Found at a request's allocation instead, it failed every request of that step."""
    make_lfm2_model("conv_attn", tmp_path / "lfm2")
    extra = {k: str(tmp_path / v) if v == "STORE" else v for k, v in extra.items()}
    with pytest.raises(ValueError, match=f"{connector} supports models with one KV cache group"):
        LLM(str(tmp_path / "lfm2"), dtype="float32", kv_transfer_config={
            "kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": extra})
