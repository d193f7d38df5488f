"""MultiConnector: load from the first child with a hit, save to every child, merge reports."""

import os

import pytest
import torch

from kvtier.connector import (
    KVConnectorOutput,
    KVConnectorRole,
    KVTransferConfig,
    create_connector,
)
from kvtier.connector.example import BlockFiles, BlockTransfer, ExampleConnectorScheduler
from kvtier.connector.multi import MultiConnectorMetadata, child_configs
from kvtier.engine.runtime import build_connectors

from .connector_testing import (
    CONTEXT,
    PLUGINS,
    AllocatedBlocks,
    empty_output,
    make_kv_caches,
    make_request,
    prefill_output,
    wait_finished_recving,
)
from .kvtier_test_connectors import TaggedReport


def example_child(path):
    return {"kv_connector": "ExampleConnector",
            "kv_connector_extra_config": {"shared_storage_path": str(path)}}


def plugin_child(name, **extra):
    return {"kv_connector": name, "kv_connector_module_path": PLUGINS,
            "kv_connector_extra_config": extra}


def make_multi(children, **config_fields):
    config = KVTransferConfig("MultiConnector",
                              kv_connector_extra_config={"connectors": children}, **config_fields)
    return (create_connector(config, KVConnectorRole.SCHEDULER, CONTEXT),
            create_connector(config, KVConnectorRole.WORKER, CONTEXT))


def run_step(worker, meta, finished_req_ids=frozenset()):
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    finished = worker.get_finished(set(finished_req_ids))
    worker.clear_connector_metadata()
    return finished


def files_in(path):
    """The block files (not the namespace description) under `path`."""
    directory = BlockFiles(str(path), CONTEXT.namespace).directory
    return sorted(name for name in os.listdir(directory) if name.endswith(".kv"))


def test_children_inherit_role_and_failure_policy():
    config = KVTransferConfig("MultiConnector", kv_role="kv_consumer",
                              kv_load_failure_policy="fail", kv_load_timeout_s=3.0,
                              kv_connector_extra_config={"connectors": [
                                  {"kv_connector": "A"},
                                  {"kv_connector": "B", "kv_role": "kv_both"}]})
    assert child_configs(config) == [
        KVTransferConfig("A", kv_role="kv_consumer", kv_load_failure_policy="fail",
                         kv_load_timeout_s=3.0),
        KVTransferConfig("B", kv_role="kv_both", kv_load_failure_policy="fail",
                         kv_load_timeout_s=3.0)]
    with pytest.raises(ValueError, match="connectors must be a non-empty list"):
        child_configs(KVTransferConfig("MultiConnector",
                                       kv_connector_extra_config={"connectors": []}))
    with pytest.raises(ValueError, match="MultiConnector extra config: unknown key 'children'"):
        child_configs(KVTransferConfig("MultiConnector",
                                       kv_connector_extra_config={"children": []}))


def test_saves_go_to_every_child(tmp_path):
    scheduler, worker = make_multi([example_child(tmp_path / "a"), example_child(tmp_path / "b")])
    assert [type(c) for c in scheduler.children] == [ExampleConnectorScheduler] * 2
    worker.register_kv_caches(make_kv_caches(seed=0))
    request = make_request("r", num_tokens=9)
    scheduler.update_state_after_alloc(request, AllocatedBlocks([1, 2, 3]), 0)
    meta = scheduler.build_connector_meta(prefill_output(request, [1, 2, 3]))
    expected = [BlockTransfer(1, request.block_hashes[0]),
                BlockTransfer(2, request.block_hashes[1])]
    assert [child.saves for child in meta.children] == [expected, expected]
    run_step(worker, meta)
    worker.shutdown()
    names = sorted(h.hex() + ".kv" for h in request.block_hashes)
    assert files_in(tmp_path / "a") == files_in(tmp_path / "b") == names


def seed_store(path, num_tokens, caches):
    """Save a prompt of `num_tokens` tokens into the ExampleConnector store at `path`."""
    scheduler, worker = make_multi([example_child(path)])
    worker.register_kv_caches(caches)
    request = make_request("seed", num_tokens=num_tokens)
    block_ids = list(range(1, 1 + (num_tokens + 3) // 4))
    scheduler.update_state_after_alloc(request, AllocatedBlocks(block_ids), 0)
    run_step(worker, scheduler.build_connector_meta(prefill_output(request, block_ids)))
    worker.shutdown()


def test_load_comes_from_the_first_child_with_a_hit(tmp_path):
    source = make_kv_caches(seed=3)
    seed_store(tmp_path / "second", num_tokens=9, caches=source)  # blocks 1, 2
    seed_store(tmp_path / "third", num_tokens=13, caches=make_kv_caches(seed=4))
    scheduler, worker = make_multi([example_child(tmp_path / "first"),
                                    example_child(tmp_path / "second"),
                                    example_child(tmp_path / "third")], kv_role="kv_consumer")
    caches = make_kv_caches(seed=None)
    worker.register_kv_caches(caches)
    request = make_request("r", num_tokens=13)
    # "second" has 2 blocks and "third" 3, but "second" comes first in the list.
    assert scheduler.get_num_new_matched_tokens(request, 0) == (8, True)
    scheduler.update_state_after_alloc(request, AllocatedBlocks([5, 6]), 8)
    request.num_computed_tokens = 8
    meta = scheduler.build_connector_meta(empty_output())
    assert isinstance(meta, MultiConnectorMetadata)
    assert [child.loads for child in meta.children] == [
        {}, {"r": [BlockTransfer(5, request.block_hashes[0]),
                   BlockTransfer(6, request.block_hashes[1])]}, {}]
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.clear_connector_metadata()
    assert wait_finished_recving(worker, "r") == set()
    for name, cache in caches.items():
        assert torch.equal(cache[:, 5:7], source[name][:, 1:3])
    assert worker.get_stats() == {"example_connector_blocks_loaded": 2}
    worker.shutdown()


def test_an_undecided_child_defers_only_when_it_comes_first(tmp_path):
    seed_store(tmp_path / "store", num_tokens=9, caches=make_kv_caches(seed=0))
    request = make_request("r", num_tokens=9)
    undecided_first, worker_a = make_multi([plugin_child("UndecidedConnector"),
                                            example_child(tmp_path / "store")])
    assert undecided_first.get_num_new_matched_tokens(request, 0) == (None, False)
    hit_first, worker_b = make_multi([example_child(tmp_path / "store"),
                                      plugin_child("UndecidedConnector")])
    assert hit_first.get_num_new_matched_tokens(request, 0) == (8, True)
    miss_only, worker_c = make_multi([example_child(tmp_path / "empty")])
    assert miss_only.get_num_new_matched_tokens(request, 0) == (0, False)
    for worker in (worker_a, worker_b, worker_c):
        worker.shutdown()


def test_finished_sending_waits_for_every_sending_child():
    scheduler, worker = make_multi([plugin_child("SendingConnector", send_steps=1),
                                    plugin_child("RecordingConnector"),
                                    plugin_child("SendingConnector", send_steps=3)])
    request = make_request("r", num_tokens=4)
    assert scheduler.request_finished(request, [1]) == (True, {"sent_by": {"send_steps": 1}})
    sending_per_step = [run_step(worker, scheduler.build_connector_meta(empty_output()),
                                 finished_req_ids={"r"} if step == 0 else set())[0]
                        for step in range(4)]
    assert sending_per_step == [set(), set(), {"r"}, set()]


def test_one_sending_child_reports_at_once():
    scheduler, worker = make_multi([plugin_child("SendingConnector", send_steps=1),
                                    plugin_child("RecordingConnector")])
    assert scheduler.request_finished(make_request("r", 4), [1])[0] is True
    assert run_step(worker, scheduler.build_connector_meta(empty_output()), {"r"}) == \
        ({"r"}, set())


def test_each_child_gets_its_own_shared_resource_and_its_own_report():
    config = KVTransferConfig("MultiConnector", kv_connector_extra_config={"connectors": [
        plugin_child("TaggedConnector", tag="a"), plugin_child("RecordingConnector"),
        plugin_child("TaggedConnector", tag="b")]})
    scheduler, worker = build_connectors(config, CONTEXT)  # as the engine builds them
    shared = [child.context.shared for child in scheduler.children]
    assert shared == [{"made_for": "a"}, None, {"made_for": "b"}]
    assert all(w.context.shared is s for w, s in zip(worker.children, shared, strict=True))
    for _ in range(2):
        run_step(worker, scheduler.build_connector_meta(empty_output()))
        scheduler.update_connector_output(
            KVConnectorOutput(connector_report=worker.build_connector_report()))
    tagged_a, _, tagged_b = scheduler.children
    assert tagged_a.reports == [TaggedReport("a", n, id(shared[0])) for n in (1, 2)]
    assert tagged_b.reports == [TaggedReport("b", n, id(shared[2])) for n in (1, 2)]
    _, quiet_worker = build_connectors(KVTransferConfig(
        "MultiConnector", kv_connector_extra_config={"connectors": [
            plugin_child("RecordingConnector")] * 2}), CONTEXT)
    assert quiet_worker.build_connector_report() is None
