"""The offloading scheduler half against the real KV cache manager: exact plans and RETRY."""

import dataclasses
import time

import pytest

from kvtier.connector.base import ConnectorContext, KVConnectorOutput
from kvtier.connector.config import KVTransferConfig
from kvtier.connector.offloading import OffloadingConnector, OffloadingConnectorScheduler
from kvtier.connector.offloading.metadata import (
    BatchDone,
    ChunkTransfer,
    OffloadingConnectorReport,
)
from kvtier.events import BlockRemoved, BlockStored, external_block_hash
from kvtier.kv import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheManager,
    KVIdentity,
    MambaSpec,
    Request,
    make_block_hasher,
)
from kvtier.offload.events import DEVICE, HOST, TierMoveEvent
from kvtier.offload.tiers.base import JobResult, LookupResult
from kvtier.router.index import KVIndex
from kvtier.sampling_params import SamplingParams
from kvtier.sched.output import NewRequestData, SchedulerOutput

from .offload_helpers import FAULTY_TIERS

BLOCK = 4
IDENTITY = KVIdentity("connector-test", "test-weights", "float32", BLOCK, "test-layout",
                      ("full_attention",))
SPEC = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=16, dtype_size=4)
KV_CONFIG = KVCacheConfig(num_blocks=32, kv_cache_groups=[
    KVCacheGroupSpec(["model.layers.0.self_attn", "model.layers.1.self_attn"], SPEC)])
CHUNK_BYTES = 2 * SPEC.page_size_bytes


@pytest.fixture
def make_connector():
    made = []

    def make(kv_config=KV_CONFIG, kv_events=True, **extra):
        options = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 16 * CHUNK_BYTES,
                   **extra}
        config = KVTransferConfig.from_dict({"kv_connector": "OffloadingConnector",
                                             "kv_connector_extra_config": options})
        context = ConnectorContext(block_size=BLOCK, num_layers=2, kv_identity=IDENTITY,
                                   kv_cache_config=kv_config, kv_events=kv_events)
        shared = OffloadingConnector.create_shared(config, context)
        connector = OffloadingConnectorScheduler(config,
                                                 dataclasses.replace(context, shared=shared))
        made.append(connector)
        return connector

    yield make
    for connector in made:
        connector.manager.shutdown()


def _request(req_id="r1", num_tokens=30):
    return Request(req_id, list(range(3, 3 + num_tokens)), SamplingParams(max_tokens=4),
                   block_hasher=make_block_hasher(BLOCK))


def _schedule_prefill(connector, kv, request):
    """Admit `request` with no cache hit and build the step's metadata, as the scheduler does."""
    kv.allocate_slots(request, request.num_tokens)
    connector.update_state_after_alloc(request, kv.get_blocks(request.request_id), 0)
    block_ids = kv.get_block_ids(request.request_id)
    output = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData(request.request_id, request.all_token_ids,
                                           request.num_prompt_tokens, SamplingParams(),
                                           block_ids, 0)],
        scheduled_cached_reqs=[], num_scheduled_tokens={request.request_id: request.num_tokens},
        total_num_scheduled_tokens=request.num_tokens)
    return connector.build_connector_meta(output), block_ids[0]


def _empty_step(connector):
    return connector.build_connector_meta(SchedulerOutput([], [], {}, 0))


def _report_done(connector, direction, transfers, **output):
    """The worker half's report that it copied `transfers`."""
    done = BatchDone(direction, tuple(t.job_id for t in transfers), True,
                     len(transfers) * CHUNK_BYTES, 0.001, 5.0)
    connector.update_connector_output(KVConnectorOutput(
        connector_report=OffloadingConnectorReport([done]), **output))


def test_prefill_plans_one_store_per_full_block(make_connector):
    connector = make_connector()
    kv = KVCacheManager(KV_CONFIG, max_model_len=64)
    request = _request()
    metadata, block_ids = _schedule_prefill(connector, kv, request)
    # 30 tokens: 7 full blocks, each a chunk, into host slots 0..6.
    assert metadata.stores == [ChunkTransfer(i, "r1", 0, i, (0,), (block_ids[i],))
                               for i in range(7)]
    assert metadata.loads == []


def test_prompt_only_and_threshold_limit_stores(make_connector):
    kv = KVCacheManager(KV_CONFIG, max_model_len=64)
    connector = make_connector(store_threshold=2)
    assert _schedule_prefill(connector, kv, _request())[0].stores == []  # seen once so far
    connector = make_connector(blocks_per_chunk=2)
    stores = _schedule_prefill(connector, kv, _request("r2"))[0].stores
    assert [(t.slot, t.block_offsets) for t in stores] == [(0, (0, 1)), (1, (0, 1)), (2, (0, 1))]


def _host_hit(connector, kv, num_tokens=30):
    """r1's 30 tokens computed and stored in host memory; r2 (its first 30 tokens the same)
    admitted with its 7 whole blocks in host memory as a hit (the last token is recomputed)."""
    first = _request("r1")
    metadata, _ = _schedule_prefill(connector, kv, first)
    _report_done(connector, "device_to_host", metadata.stores)
    second = _request("r2", num_tokens=num_tokens)
    assert connector.get_num_new_matched_tokens(second, 0) == (28, False)
    kv.allocate_slots(second, num_tokens - 28, num_external_computed_tokens=28)
    connector.update_state_after_alloc(second, kv.get_blocks("r2"), 28)
    return first, second


def test_host_hit_loads_by_block_id(make_connector):
    connector = make_connector()
    kv = KVCacheManager(KV_CONFIG, max_model_len=64)
    first, _ = _host_hit(connector, kv)
    loads = _empty_step(connector).loads
    block_ids = kv.get_block_ids("r2")[0]
    assert [(t.slot, t.block_ids) for t in loads] == [(i, (block_ids[i],)) for i in range(7)]
    entries = connector.manager.host.entries
    assert [entry.num_readers for entry in entries.values()] == [1] * 7
    _report_done(connector, "host_to_device", loads)
    assert [entry.num_readers for entry in entries.values()] == [0] * 7
    assert connector.flush(timeout_s=5)  # every copy reported, no tier job left
    # Named by the blocks' own 64-bit hashes; the loads back into the device are left to the
    # device cache's own events.
    hashes = [external_block_hash(h) for h in first.block_hashes[:7]]
    assert connector.take_events() == [BlockStored([h], None, [], BLOCK, None, "CPU",
                                                   group_idx=0) for h in hashes]


def test_no_events_are_made_when_the_engine_publishes_none(make_connector):
    connector = make_connector(kv_events=False)
    kv = KVCacheManager(KV_CONFIG, max_model_len=64)
    _host_hit(connector, kv)
    _report_done(connector, "host_to_device", _empty_step(connector).loads)
    assert connector.manager.host.entries  # the same moves happened
    assert connector.take_events() == []
    assert connector._event_names is None  # and no chunk was named for them


def _prompt(req_id, token_ids):
    return Request(req_id, token_ids, SamplingParams(max_tokens=4),
                   block_hasher=make_block_hasher(BLOCK))


def _store_prompt(connector, kv, request):
    """Prefill `request` and report its chunks stored in host memory; its blocks' hashes."""
    metadata, _ = _schedule_prefill(connector, kv, request)
    _report_done(connector, "device_to_host", metadata.stores)
    return [external_block_hash(h) for h in request.block_hashes]


def test_a_block_two_chunks_hold_stays_announced_until_both_are_gone(make_connector):
    # 2-block chunks, 2 host slots. r1 and r2 share their first block and differ in the
    # second: two chunks that both hold block a0. Evicting r1's chunk leaves a0 in host memory.
    connector = make_connector(blocks_per_chunk=2, cpu_bytes_to_use=4 * CHUNK_BYTES)
    kv = KVCacheManager(KV_CONFIG, max_model_len=64)
    a0, a1 = _store_prompt(connector, kv, _prompt("r1", list(range(3, 12))))
    _, b1 = _store_prompt(connector, kv, _prompt("r2", [3, 4, 5, 6, 100, 101, 102, 103, 104]))
    c0, c1 = _store_prompt(connector, kv, _prompt("r3", list(range(200, 209))))  # evicts r1's
    events = connector.take_events()
    assert events == [
        BlockStored([a0, a1], None, [], BLOCK, None, "CPU", group_idx=0),
        BlockStored([b1], None, [], BLOCK, None, "CPU", group_idx=0),  # a0 is announced
        BlockRemoved([a1], "CPU", 0),  # a0 is still held, by r2's chunk
        BlockStored([c0, c1], None, [], BLOCK, None, "CPU", group_idx=0)]
    router = KVIndex(max_blocks=64)
    for event in events:
        apply = router.store if isinstance(event, BlockStored) else router.remove
        apply(1, event.block_hashes, event.medium)
    assert router.match([a0, b1], [1])[1].num_blocks == 2  # r2's prefix, in host memory


def test_each_tier_announces_a_chunk_once_and_a_block_while_a_chunk_there_holds_it(
        make_connector):
    connector = make_connector(blocks_per_chunk=2, secondary_tiers=[
        {"type": "memory", "name": "mem"}])
    r1, r2 = _prompt("r1", list(range(3, 12))), _prompt("r2", [3, 4, 5, 6, 9, 9, 9, 9, 9])
    [k1], [k2] = connector.chunk_keys(r1, 0, 0, 1), connector.chunk_keys(r2, 0, 0, 1)
    a0, a1, b1 = (external_block_hash(h) for h in (*r1.block_hashes, r2.block_hashes[1]))
    events = connector._event_names.wire_events([
        TierMoveEvent(k1, DEVICE, HOST), TierMoveEvent(k1, HOST, "mem"),
        TierMoveEvent(k1, HOST, "mem"),  # the same chunk stored on the tier again
        TierMoveEvent(k2, DEVICE, HOST), TierMoveEvent(k1, HOST, None),
        TierMoveEvent(k2, HOST, None), TierMoveEvent(k1, "mem", None)])
    assert [(type(e).__name__, e.medium, e.block_hashes) for e in events] == [
        ("BlockStored", "CPU", [a0, a1]), ("BlockStored", "STORAGE", [a0, a1]),
        ("BlockStored", "CPU", [b1]), ("BlockRemoved", "CPU", [a1]),
        ("BlockRemoved", "CPU", [a0, b1]), ("BlockRemoved", "STORAGE", [a0, a1])]


def test_a_host_hit_plans_no_stores_for_what_it_loads(make_connector):
    connector = make_connector()
    kv = KVCacheManager(KV_CONFIG, max_model_len=64)
    _, second = _host_hit(connector, kv, num_tokens=34)  # then one more block of its own
    block_ids = kv.get_block_ids("r2")
    output = SchedulerOutput(
        scheduled_new_reqs=[NewRequestData("r2", second.all_token_ids, second.num_prompt_tokens,
                                           SamplingParams(), block_ids, 28)],
        scheduled_cached_reqs=[], num_scheduled_tokens={"r2": 6}, total_num_scheduled_tokens=6)
    asked = []
    prepare_store = connector.manager.prepare_store
    connector.manager.prepare_store = lambda key, *args: asked.append(key) or prepare_store(
        key, *args)
    metadata = connector.build_connector_meta(output)
    assert len(metadata.loads) == 7
    # Only the block it computes is asked for a slot and stored: the loaded ones are in host
    # memory (an 8k-token hit would ask 511 times for nothing).
    assert asked == [connector.chunk_keys(second, 0, 7, 8)[0]]
    assert [t.block_ids for t in metadata.stores] == [(block_ids[0][7],)]


def test_secondary_hit_answers_retry_until_promoted(make_connector):
    connector = make_connector(secondary_tiers=[{"type": "StuckTier",
                                                  "module_path": FAULTY_TIERS}])
    stuck = connector.manager.tiers[0]
    request = _request()
    assert connector.get_num_new_matched_tokens(request, 0) == (None, False)
    assert len(stuck.held) == 7  # every chunk's promotion started in the first lookup
    assert connector.get_num_new_matched_tokens(request, 0) == (None, False)
    assert len(stuck.held) == 7  # none started twice
    stuck.release(ok=True)
    _empty_step(connector)
    assert connector.get_num_new_matched_tokens(request, 0) == (28, False)
    # Three asks, counted once per chunk: each missed the host and was found on the tier.
    stats = connector.manager.metrics.snapshot()
    assert stats['kvtier:offload_tier_queries_total{tier="StuckTier"}'] == 7
    assert stats['kvtier:offload_tier_hits_total{tier="StuckTier"}'] == 7
    assert stats['kvtier:offload_tier_queries_total{tier="host"}'] == 7
    assert stats.get('kvtier:offload_tier_hits_total{tier="host"}', 0) == 0
    connector.request_finished(request, [])  # a new request with the same chunks counts anew
    assert connector.get_num_new_matched_tokens(_request("r2"), 0) == (28, False)
    stats = connector.manager.metrics.snapshot()
    assert stats['kvtier:offload_tier_hits_total{tier="host"}'] == 7
    assert stats['kvtier:offload_tier_queries_total{tier="host"}'] == 14


def test_a_request_is_not_looked_up_again_until_its_promotions_end(make_connector):
    # An 8k-token prompt's lookup takes ~2 ms of the engine thread, which the tier's read
    # threads wait on: re-asking for a request whose chunks are still on their way is free.
    connector = make_connector(secondary_tiers=[{"type": "StuckTier",
                                                  "module_path": FAULTY_TIERS}])
    stuck, manager, request = connector.manager.tiers[0], connector.manager, _request()
    asked, lookup, count_ready = [], manager.lookup, manager.host.count_ready
    manager.lookup = lambda key, *args, **kwargs: asked.append(key) or lookup(key, *args,
                                                                               **kwargs)
    # Host hits are found a run at a time: the keys of each run asked for count as asked.
    manager.host.count_ready = lambda keys: (asked.extend(keys[:count_ready(keys)])
                                             or count_ready(keys))
    assert connector.get_num_new_matched_tokens(request, 0) == (None, False)
    assert len(asked) == 7
    # Every chunk but the first has arrived: still waiting, and nothing is asked again.
    first, *rest = stuck.held
    stuck.held, stuck._released = [first], [JobResult(job.job_id, ok=True) for job in rest]
    _empty_step(connector)
    assert connector.get_num_new_matched_tokens(request, 0) == (None, False)
    assert len(asked) == 7
    stuck.release(ok=True)
    _empty_step(connector)
    assert connector.get_num_new_matched_tokens(request, 0) == (28, False)
    assert len(asked) == 14 and len(set(asked)) == 7


def test_a_chunk_a_tier_cannot_tell_yet_is_asked_again_next_step(make_connector):
    # Chunk 3 is on a tier still finding out (UNKNOWN); the others are on their way up. The
    # next step asks again rather than wait for the promotions first.
    connector = make_connector(secondary_tiers=[{"type": "StuckTier",
                                                  "module_path": FAULTY_TIERS}])
    stuck, manager, request = connector.manager.tiers[0], connector.manager, _request()
    undecided = connector.chunk_keys(request, 0, 3, 4)[0]
    lookup = stuck.lookup
    stuck.lookup = lambda key, *args: (LookupResult.UNKNOWN if key == undecided
                                       else lookup(key, *args))
    assert connector.get_num_new_matched_tokens(request, 0) == (None, False)
    assert len(stuck.held) == 6
    stuck.lookup = lookup  # it found out: the tier has it
    assert connector.get_num_new_matched_tokens(request, 0) == (None, False)
    assert len(stuck.held) == 7 and manager.is_promoting(undecided)
    stuck.release(ok=True)
    _empty_step(connector)
    assert connector.get_num_new_matched_tokens(request, 0) == (28, False)


def test_failed_promotion_ends_the_hit_there(make_connector):
    connector = make_connector(secondary_tiers=[{"type": "StuckTier",
                                                  "module_path": FAULTY_TIERS}])
    stuck = connector.manager.tiers[0]
    assert connector.get_num_new_matched_tokens(_request(), 0) == (None, False)
    stuck._released = [JobResult(job.job_id, ok=chunk != 2)  # jobs in chunk order
                       for chunk, job in enumerate(stuck.held)]
    _empty_step(connector)
    # Chunk 2's promotion failed: the first two chunks are a hit, the rest recompute.
    assert connector.get_num_new_matched_tokens(_request(), 0) == (8, False)


def test_request_longer_than_the_host_tier_stops_waiting_for_promotions(make_connector):
    # Host: 4 slots; the request's 7 chunks are all on the memory tier. Each step's promotions
    # evict the chunks the previous step promoted, so waiting for all 7 never ends; after one
    # tier-job deadline the request takes what is in host memory and recomputes the rest.
    connector = make_connector(cpu_bytes_to_use=4 * CHUNK_BYTES, tier_job_timeout_s=0.3,
                               secondary_tiers=[{"type": "memory"}])
    manager, request = connector.manager, _request()
    for chunk in range(7):
        key = connector.chunk_keys(request, 0, chunk, chunk + 1)[0]
        manager.record_use(key)
        manager.prepare_store(key, CHUNK_BYTES)
        manager.complete_store(key, ok=True)  # cascades to the memory tier
        manager.poll()
    asker = _request("r2")
    deadline = time.monotonic() + 5
    while (answer := connector.get_num_new_matched_tokens(asker, 0)) == (None, False):
        assert time.monotonic() < deadline, "the request waits for its promotions forever"
        _empty_step(connector)
    num_tokens, load_async = answer
    assert num_tokens % BLOCK == 0 and num_tokens <= 4 * BLOCK  # at most what the host holds
    assert load_async is False  # what it counts is in host memory: loaded with its forward
    assert time.monotonic() > deadline - 5 + 0.3  # it did wait one deadline first


# A hybrid model: one attention layer and one recurrent-state layer (a 2 x 8 state per block).
HYBRID_CONFIG = KVCacheConfig(num_blocks=40, kv_cache_groups=[
    KVCacheGroupSpec(["model.layers.0.self_attn"], SPEC),
    KVCacheGroupSpec(["model.layers.1.conv"], MambaSpec(BLOCK, ((2, 8),), 4))])


def test_a_state_chunk_is_the_state_after_the_chunks_last_block(make_connector):
    connector = make_connector(HYBRID_CONFIG, blocks_per_chunk=2)
    assert [layout.blocks_per_chunk for layout in connector.layouts] == [2, 1]
    kv = KVCacheManager(HYBRID_CONFIG, max_model_len=64)
    request = _request()
    metadata, _ = _schedule_prefill(connector, kv, request)
    attention_ids, state_ids = kv.get_block_ids("r1")
    # 30 tokens: 3 whole 2-block chunks per group; a state chunk is its last block alone.
    assert [(t.group_id, t.block_offsets, t.block_ids) for t in metadata.stores] == [
        (g, offsets, ids) for c in range(3) for g, offsets, ids in (
            (0, (0, 1), tuple(attention_ids[2 * c:2 * c + 2])), (1, (0,), (state_ids[2 * c + 1],)))]


def test_a_missing_state_chunk_ends_the_hit_at_the_last_state_there(make_connector):
    connector = make_connector(HYBRID_CONFIG, blocks_per_chunk=2)
    kv = KVCacheManager(HYBRID_CONFIG, max_model_len=64)
    metadata, _ = _schedule_prefill(connector, kv, _request("r1"))
    lost = [t for t in metadata.stores if t.group_id == 1][-1]  # the state after chunk 2
    _report_done(connector, "device_to_host", [t for t in metadata.stores if t is not lost])
    failed = BatchDone("device_to_host", (lost.job_id,), False, 0, 0.001, 5.0)
    connector.update_connector_output(
        KVConnectorOutput(connector_report=OffloadingConnectorReport([failed])))
    second = _request("r2")
    # Attention has all 3 chunks, the state after chunk 2 is gone: resume after chunk 1.
    assert connector.get_num_new_matched_tokens(second, 0)[0] == 16
    kv.allocate_slots(second, 14, num_external_computed_tokens=16)
    connector.update_state_after_alloc(second, kv.get_blocks("r2"), 16)
    attention_ids, state_ids = kv.get_block_ids("r2")
    assert state_ids[:3] == [0, 0, 0]  # only the state after token 16 is kept
    loads = _empty_step(connector).loads
    assert [(t.group_id, t.block_offsets, t.block_ids) for t in loads] == [
        (0, (0, 1), tuple(attention_ids[0:2])), (0, (0, 1), tuple(attention_ids[2:4])),
        (1, (0,), (state_ids[3],))]
    kv.check_invariants()
