"""The asynchronous remote-KV lifecycle with a scripted connector."""

from kvtier.connector.base import KVConnectorOutput
from kvtier.kv import RequestStatus

from .sched_fakes import (
    Clock,
    FakeRunner,
    ScriptedConnector,
    StepMeta,
    assert_all_free,
    make_request,
    make_scheduler,
    prompt,
    step,
)


def probe_hit(manager, tokens):
    """Tokens of `tokens` a newcomer would find in the device prefix cache."""
    return manager.get_computed_blocks(make_request("probe", tokens))[1]


def recv(*req_ids, invalid=()):
    return KVConnectorOutput(finished_recving=set(req_ids), invalid_block_ids=set(invalid))


def test_async_load_lifecycle(managers):
    manager = managers(16)
    connector = ScriptedConnector(answers={"a": [(8, True)]})
    sched = make_scheduler(manager, connector)
    runner = FakeRunner()
    a = make_request("a", prompt(0, 12), max_tokens=1)
    sched.add_request(a)

    out, core = step(sched, runner)  # allocate for the load, compute nothing
    assert (out.is_empty, core) == (True, [])
    assert out.kv_connector_metadata == StepMeta(step=1)
    assert connector.queries == [("a", 0)]
    assert connector.allocs == [("a", [1, 2], 8)]
    assert (a.status, a.num_computed_tokens) == (RequestStatus.WAITING_FOR_REMOTE_KVS, 8)
    assert probe_hit(manager, prompt(0, 12)) == 0  # not cached before the data is there
    assert sched.make_stats().num_waiting_for_remote_kvs == 1

    out, _ = step(sched, runner, recv("a"))  # still waiting this step; the load lands
    assert out.is_empty and a.status == RequestStatus.WAITING_FOR_REMOTE_KVS
    assert connector.outputs[-1].finished_recving == {"a"}

    out, core = step(sched, runner)  # promoted, cached, scheduled from token 8
    new = out.scheduled_new_reqs[0]
    assert (new.req_id, new.block_ids, new.num_computed_tokens) == ("a", ([1, 2, 3],), 8)
    assert out.num_scheduled_tokens == {"a": 4}
    assert probe_hit(manager, prompt(0, 12)) == 8
    assert [(o.new_token_ids, o.finish_reason, o.num_cached_tokens) for o in core] == [
        ([12], "length", 8)]
    assert connector.num_metas == 3  # one metadata per step
    assert connector.queries == [("a", 0)]
    assert_all_free(manager)


def test_whole_prompt_load_recomputes_the_last_token(managers):
    manager = managers(16)
    connector = ScriptedConnector(answers={"a": [(8, True)]})
    sched = make_scheduler(manager, connector)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 8), max_tokens=1))
    step(sched, runner, recv("a"))
    out, core = step(sched, runner)
    new = out.scheduled_new_reqs[0]
    assert (new.block_ids, new.num_computed_tokens) == (([1, 2],), 7)
    assert out.num_scheduled_tokens == {"a": 1}
    assert core[0].new_token_ids == [8]
    assert_all_free(manager)


def test_synchronous_external_hit_keeps_the_last_token_to_compute(managers):
    manager = managers(16)
    connector = ScriptedConnector(answers={"a": [(8, False)]})
    sched = make_scheduler(manager, connector)
    sched.add_request(make_request("a", prompt(0, 8), max_tokens=1))
    out, core = step(sched, FakeRunner())
    assert connector.allocs == [("a", [1, 2], 7)]
    assert (out.scheduled_new_reqs[0].num_computed_tokens, out.num_scheduled_tokens) == (
        7, {"a": 1})
    assert_all_free(manager)


def test_failed_partial_load_caches_only_the_valid_prefix(managers):
    manager = managers(16)
    connector = ScriptedConnector(answers={"a": [(8, True)]})
    sched = make_scheduler(manager, connector)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 12), max_tokens=1))
    step(sched, runner, recv("a", invalid=[2]))  # block 2 (tokens 4..7) arrived bad
    assert sched.requests["a"].num_computed_tokens == 4
    assert probe_hit(manager, prompt(0, 12)) == 0
    out, core = step(sched, runner)
    new = out.scheduled_new_reqs[0]
    assert (new.block_ids, new.num_computed_tokens) == (([1, 2, 3],), 4)
    assert out.num_scheduled_tokens == {"a": 8}
    assert connector.queries == [("a", 0)]  # recomputes, does not ask again
    stats = sched.make_stats()
    assert (stats.num_kv_load_failures, stats.num_kv_load_timeouts) == (1, 0)
    assert core[0].finish_reason == "length"
    assert_all_free(manager)


def test_load_failed_from_its_first_block_recomputes_everything(managers):
    manager = managers(16)
    connector = ScriptedConnector(answers={"a": [(8, True)]})
    sched = make_scheduler(manager, connector)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 12), max_tokens=1))
    step(sched, runner, recv("a", invalid=[1, 2]))
    out, _ = step(sched, runner)
    new = out.scheduled_new_reqs[0]
    # Its load blocks were freed (tail: 2, 1); fresh blocks come from the head.
    assert (new.block_ids, new.num_computed_tokens) == (([3, 4, 5],), 0)
    assert out.num_scheduled_tokens == {"a": 12}
    assert connector.queries == [("a", 0)]
    assert_all_free(manager)


def test_invalid_blocks_fail_policy_finishes_a_loading_request(managers):
    manager = managers(16)
    connector = ScriptedConnector(answers={"a": [(8, True)]})
    sched = make_scheduler(manager, connector, kv_load_failure_policy="fail")
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 12)))
    _, core = step(sched, runner, recv("a", invalid=[2]))
    assert [(o.req_id, o.finish_reason, o.new_token_ids) for o in core] == [("a", "error", [])]
    assert "kv_load_failure_policy='fail'" in core[0].error and core[0].finished
    assert not sched.has_unfinished_requests()
    assert connector.finished == [("a", [1, 2])]
    assert sched.schedule().finished_req_ids == {"a"}
    assert_all_free(manager)


def test_invalid_blocks_of_a_synchronous_load_under_both_policies(managers):
    for policy in ("recompute", "fail"):
        manager = managers(16)
        connector = ScriptedConnector(answers={"a": [(8, False)]})
        sched = make_scheduler(manager, connector, kv_load_failure_policy=policy)
        runner = FakeRunner()
        sched.add_request(make_request("a", prompt(0, 12), max_tokens=2))
        out, core = step(sched, runner, KVConnectorOutput(invalid_block_ids={2}))
        assert out.num_scheduled_tokens == {"a": 4}
        assert probe_hit(manager, prompt(0, 12)) == 4  # the bad block left the prefix cache
        # Block 3 was computed over the bad block 2: it leaves the prefix cache too.
        assert [manager.block_pool.blocks[i].cache_key is None for i in (1, 2, 3)] == [
            False, True, True]
        if policy == "fail":
            assert [(o.finish_reason, o.new_token_ids) for o in core] == [("error", [])]
            assert_all_free(manager)
            continue
        assert core == []  # the token sampled from bad KV is dropped
        out, core = step(sched, runner)  # the runner rebuilds a from token 4
        assert out.preempted_req_ids == {"a"}
        new = out.scheduled_new_reqs[0]
        assert (new.token_ids, new.block_ids, new.num_computed_tokens) == (
            prompt(0, 12), ([1, 2, 3],), 4)
        assert out.num_scheduled_tokens == {"a": 8}
        assert [o.new_token_ids for o in core] == [[12]]
        step(sched, runner)
        assert_all_free(manager)


def test_abort_during_load_frees_blocks_only_when_the_load_ends(managers):
    manager = managers(16)
    connector = ScriptedConnector(answers={"a": [(8, True)]})
    sched = make_scheduler(manager, connector)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 12)))
    step(sched, runner)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert connector.finished == [("a", [1, 2])]
    assert manager.num_free_blocks == 15 - 2  # the worker may still write into 1 and 2
    assert sched.has_pending_kv_transfers() and not sched.has_unfinished_requests()
    out, _ = step(sched, runner, recv("a"))
    assert out.finished_req_ids == {"a"}
    assert not sched.has_pending_kv_transfers()
    assert_all_free(manager)


def test_producer_blocks_held_until_finished_sending(managers):
    manager = managers(6)  # usable blocks 1..5
    connector = ScriptedConnector(delay_free={"a"})
    sched = make_scheduler(manager, connector)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 12), max_tokens=1))
    _, core = step(sched, runner)
    assert (core[0].finish_reason, core[0].kv_transfer_params) == (
        "length", {"remote_blocks": [1, 2, 3]})
    sched.add_request(make_request("b", prompt(100, 9), max_tokens=1))
    out, _ = step(sched, runner)  # b needs 3 blocks; a's 3 are still being sent
    assert out.is_empty and manager.num_free_blocks == 2
    out, _ = step(sched, runner, KVConnectorOutput(finished_sending={"a"}))
    assert out.is_empty
    out, _ = step(sched, runner)
    assert out.scheduled_new_reqs[0].block_ids == ([4, 5, 3],)
    assert_all_free(manager)


def test_none_deferral_keeps_fcfs_order(managers):
    manager = managers(32)
    connector = ScriptedConnector(answers={"a": [(None, False), (0, False)]})
    sched = make_scheduler(manager, connector, max_num_seqs=2)
    runner = FakeRunner()
    for name, start in (("a", 0), ("b", 100), ("c", 200), ("d", 300)):
        sched.add_request(make_request(name, prompt(start, 4), max_tokens=2))
    out, _ = step(sched, runner)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["b", "c"]
    assert [r.request_id for r in sched.waiting] == ["a", "d"]
    out, _ = step(sched, runner)  # b and c finish; no seat, so nobody is asked
    assert [r.request_id for r in sched.waiting] == ["a", "d"]
    out, _ = step(sched, runner)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a", "d"]
    assert [q for q in connector.queries if q[0] == "a"] == [("a", 0)] * 2
    step(sched, runner)
    assert_all_free(manager)


def test_deferrals_stop_asking_past_the_fetch_lookahead(managers):
    """Each request asked starts a fetch of its KV: once the deferred ones hold two steps'
    worth of tokens (2 x 64 here), the rest of the queue waits for the next step."""
    manager = managers(64)
    names = ("a", "b", "c", "d", "e")
    connector = ScriptedConnector(answers={n: [(None, False), (0, False)] for n in names})
    sched = make_scheduler(manager, connector)
    runner = FakeRunner()
    for i, name in enumerate(names):
        sched.add_request(make_request(name, prompt(100 * i, 50), max_tokens=1))
    out, _ = step(sched, runner)
    assert out.is_empty
    assert [q[0] for q in connector.queries] == ["a", "b", "c"]  # 150 tokens >= 128
    assert [r.request_id for r in sched.waiting] == list(names)
    out, _ = step(sched, runner)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a", "b"]  # 50 + 14 of 64 tokens
    assert [q[0] for q in connector.queries[3:]] == ["a", "b"]


def test_waiting_for_remote_kvs_holds_its_place(managers):
    manager = managers(32)
    connector = ScriptedConnector(answers={"a": [(4, True)]})
    sched = make_scheduler(manager, connector, max_num_seqs=1)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 8), max_tokens=1))
    sched.add_request(make_request("b", prompt(100, 8), max_tokens=1))
    sched.add_request(make_request("c", prompt(200, 8), max_tokens=1))
    out, _ = step(sched, runner, recv("a"))  # a starts loading; b takes the one seat
    assert [n.req_id for n in out.scheduled_new_reqs] == ["b"]
    assert [r.request_id for r in sched.waiting] == ["a", "c"]
    out, _ = step(sched, runner)
    assert [n.req_id for n in out.scheduled_new_reqs] == ["a"]  # ahead of c
    assert_all_free_after(sched, runner, manager)


def test_load_past_its_deadline_falls_back_to_recompute(managers):
    manager = managers(16)
    clock = Clock()
    connector = ScriptedConnector(answers={"a": [(8, True)]})
    sched = make_scheduler(manager, connector, clock, kv_load_timeout_s=5.0)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 12), max_tokens=1))
    step(sched, runner)
    clock.now = 4.0
    out, _ = step(sched, runner)
    assert out.is_empty
    clock.now = 5.5
    out, core = step(sched, runner)
    new = out.scheduled_new_reqs[0]
    # Blocks 1 and 2 stay with the late load; the recompute gets fresh ones.
    assert (new.block_ids, new.num_computed_tokens) == (([3, 4, 5],), 0)
    assert core[0].finish_reason == "length"
    assert sched.make_stats().num_kv_load_timeouts == 1
    assert manager.num_free_blocks == 15 - 2 and sched.has_pending_kv_transfers()
    step(sched, runner, recv("a"))  # the late load ends: its blocks are released
    assert not sched.has_pending_kv_transfers()
    assert connector.queries == [("a", 0)]
    assert_all_free(manager)


def test_preempted_request_resumes_through_an_async_load(managers):
    manager = managers(5)  # usable blocks 1..4
    connector = ScriptedConnector(answers={"b": [(0, False), (4, True)]})
    sched = make_scheduler(manager, connector)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 8), max_tokens=2))
    sched.add_request(make_request("b", prompt(100, 7), max_tokens=2))
    step(sched, runner)
    out, _ = step(sched, runner)
    assert out.preempted_req_ids == {"b"}
    b = sched.requests["b"]
    out, _ = step(sched, runner)  # a finished; b: local hit 4 + external 4 = all 8 tokens
    assert connector.queries[-1] == ("b", 4)
    assert connector.allocs[-1] == ("b", [3, 4], 4)
    assert (b.status, b.num_computed_tokens) == (RequestStatus.WAITING_FOR_REMOTE_KVS, 8)
    step(sched, runner, recv("b"))
    out, core = step(sched, runner)
    # Promotion restored PREEMPTED (not WAITING) before the request was allocated again.
    assert connector.alloc_statuses[-1] == RequestStatus.PREEMPTED
    new = out.scheduled_new_reqs[0]
    assert (new.req_id, new.token_ids, new.block_ids, new.num_computed_tokens) == (
        "b", prompt(100, 8), ([3, 4],), 7)
    assert b.num_preemptions == 1 and core[0].new_token_ids == [108]
    assert_all_free(manager)


def assert_all_free_after(sched, runner, manager):
    for _ in range(10):
        if not sched.has_unfinished_requests():
            break
        step(sched, runner)
    assert_all_free(manager)


def test_stats_and_events_from_the_worker_reach_the_engine(managers):
    manager = managers(16, enable_kv_cache_events=True)
    connector = ScriptedConnector()
    sched = make_scheduler(manager, connector)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 4), max_tokens=2))
    step(sched, runner, KVConnectorOutput(stats={"bytes_loaded": 10.0}, events=["e1"]))
    step(sched, runner, KVConnectorOutput(stats={"bytes_loaded": 5.0}, events=["e2"]))
    stats = sched.make_stats()
    assert stats.connector_stats == {"bytes_loaded": 15.0}
    assert sched.make_stats().connector_stats == {}
    worker_events = [e for e in sched.take_kv_events() if isinstance(e, str)]  # not the pool's
    assert worker_events == ["e1", "e2"] and sched.take_kv_events() == []
    assert [o.stats for o in connector.outputs] == [{"bytes_loaded": 10.0}, {"bytes_loaded": 5.0}]
    assert_all_free(manager)


def test_events_are_dropped_every_step_when_nobody_publishes_them(managers):
    """Offline use has no publisher: connector events must not pile up step after step."""
    manager = managers(16)
    connector = ScriptedConnector()
    connector.events = ["c1"]
    sched = make_scheduler(manager, connector)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 4), max_tokens=2))
    step(sched, runner, KVConnectorOutput(events=["e1"]))
    assert connector.events == [] and sched.take_kv_events() == []


def test_the_engine_stops_waiting_for_a_send_never_reported(managers):
    manager = managers(16)
    clock = Clock()
    connector = ScriptedConnector(delay_free={"a"})
    sched = make_scheduler(manager, connector, clock, kv_load_timeout_s=5.0)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 4), max_tokens=1))
    step(sched, runner)
    clock.now = 5.0
    assert sched.has_pending_kv_transfers()
    clock.now = 5.5
    # Nobody waits any more, but the blocks stay held: the send may still read them.
    assert not sched.has_pending_kv_transfers()
    assert manager.num_free_blocks == 15 - 1
    step(sched, runner, KVConnectorOutput(finished_sending={"a"}))
    assert_all_free(manager)


def test_connector_undecided_past_the_deadline_is_admitted_without_it(managers):
    manager = managers(16)
    clock = Clock()
    connector = ScriptedConnector(answers={"a": [(None, False)], "b": [(None, False), (0, False)]})
    sched = make_scheduler(manager, connector, clock, kv_load_timeout_s=5.0)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 12), max_tokens=1))
    sched.add_request(make_request("b", prompt(100, 4), max_tokens=1))
    out, _ = step(sched, runner)  # both: "not yet"
    assert out.is_empty
    clock.now = 5.0
    out, _ = step(sched, runner)  # b decided (nothing to load); a still within its deadline
    assert [new.req_id for new in out.scheduled_new_reqs] == ["b"]
    clock.now = 5.5
    out, core = step(sched, runner)
    new = out.scheduled_new_reqs[0]
    assert (new.req_id, new.num_computed_tokens, out.num_scheduled_tokens) == ("a", 0, {"a": 12})
    assert connector.allocs == [("b", [1], 0), ("a", [2, 3, 4], 0)]
    assert [q[0] for q in connector.queries] == ["a", "b", "a", "b", "a"]  # not asked again
    assert core[0].finish_reason == "length"
    assert sched.make_stats().num_connector_lookup_timeouts == 1
    assert sched.make_stats().num_connector_lookup_timeouts == 0  # a counter: since last time
    assert_all_free(manager)


def test_admission_leaves_the_blocks_an_in_flight_load_still_needs(managers):
    manager = managers(8)  # usable blocks 1..7
    connector = ScriptedConnector(answers={"a": [(8, True)]})
    sched = make_scheduler(manager, connector)
    runner = FakeRunner()
    a = make_request("a", prompt(0, 16), max_tokens=1)
    sched.add_request(a)
    sched.add_request(make_request("b", prompt(100, 16), max_tokens=1))
    out, _ = step(sched, runner)
    # a loads 8 tokens into blocks 1, 2 and needs 2 more for the rest of its prompt. b needs 4:
    # the 5 free blocks would hold it, leaving a 1 when its load lands.
    assert connector.allocs == [("a", [1, 2], 8)]
    assert manager.num_blocks_to_finish_prefill(a) == 2 and manager.num_free_blocks == 5
    assert out.is_empty and [r.request_id for r in sched.waiting] == ["a", "b"]
    out, _ = step(sched, runner, recv("a"))  # the load lands; b still may not take a's blocks
    assert out.is_empty and manager.num_free_blocks == 5
    out, _ = step(sched, runner)  # a goes on from its loaded blocks
    assert [(new.req_id, new.block_ids) for new in out.scheduled_new_reqs] == [
        ("a", ([1, 2, 3, 4],))]
    out, _ = step(sched, runner)  # a finished and freed its blocks: now b fits
    assert [new.req_id for new in out.scheduled_new_reqs] == ["b"]
    assert_all_free_after(sched, runner, manager)


def test_a_landed_load_may_use_the_blocks_other_loads_reserve(managers):
    manager = managers(8)  # usable blocks 1..7
    connector = ScriptedConnector(answers={"a": [(8, True)], "b": [(8, True)]})
    sched = make_scheduler(manager, connector, enable_chunked_prefill=False)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 16), max_tokens=1))
    sched.add_request(make_request("b", prompt(100, 20), max_tokens=1))
    step(sched, runner)  # both load: a will need 2 more blocks, b 3 more; 3 are free
    assert connector.allocs == [("a", [1, 2], 8), ("b", [3, 4], 8)]
    step(sched, runner, recv("a"))
    # a goes on with 2 of the blocks b reserves: held back, it would block b behind it for good.
    out, _ = step(sched, runner)
    assert [(new.req_id, new.block_ids) for new in out.scheduled_new_reqs] == [
        ("a", ([1, 2, 5, 6],))]
    step(sched, runner, recv("b"))
    out, _ = step(sched, runner)
    assert [new.req_id for new in out.scheduled_new_reqs] == ["b"]
    assert_all_free_after(sched, runner, manager)
