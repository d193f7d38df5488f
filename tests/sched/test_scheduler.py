"""Continuous batching without a connector: order, budgets, preemption, abort, stops."""

import pytest

from kvtier.kv import Request, RequestStatus, make_block_hasher
from kvtier.sched import SchedulerQueueFullError

from .sched_fakes import (
    EOS,
    FakeRunner,
    assert_all_free,
    make_request,
    make_scheduler,
    prompt,
    run_to_completion,
    step,
)


def new_ids(out):
    return [new.req_id for new in out.scheduled_new_reqs]


def test_fcfs_order_max_num_seqs_and_block_ids(managers):
    manager = managers(32)
    sched = make_scheduler(manager, max_num_seqs=2)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 6), max_tokens=2))
    sched.add_request(make_request("b", prompt(100, 10)))
    sched.add_request(make_request("c", prompt(200, 4)))

    out, core = step(sched, runner)
    assert new_ids(out) == ["a", "b"]
    assert [new.block_ids for new in out.scheduled_new_reqs] == [([1, 2],), ([3, 4, 5],)]
    assert out.num_scheduled_tokens == {"a": 6, "b": 10}
    assert out.total_num_scheduled_tokens == 16
    assert [(o.req_id, o.new_token_ids) for o in core] == [("a", [6]), ("b", [110])]

    out, core = step(sched, runner)  # decodes; c has no seat
    assert new_ids(out) == []
    assert [(c.req_id, c.new_block_ids, c.num_computed_tokens)
            for c in out.scheduled_cached_reqs] == [("a", ([],), 6), ("b", ([],), 10)]
    assert [(o.req_id, o.finish_reason) for o in core] == [("a", "length"), ("b", None)]

    out, _ = step(sched, runner)  # a's seat goes to c; a's blocks went to the free tail
    assert out.finished_req_ids == {"a"}
    assert [(n.req_id, n.block_ids) for n in out.scheduled_new_reqs] == [("c", ([6],))]
    sched.finish_requests(["b", "c"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(manager)


def test_priority_policy_admits_lowest_value_first(managers):
    manager = managers(32)
    sched = make_scheduler(manager, policy="priority", max_num_seqs=2)
    runner = FakeRunner()
    sched.add_request(make_request("x", prompt(0, 4), arrival=0.0, priority=1))
    sched.add_request(make_request("z", prompt(10, 4), arrival=2.0, priority=0))
    sched.add_request(make_request("y", prompt(20, 4), arrival=1.0, priority=0))
    out, _ = step(sched, runner)
    assert new_ids(out) == ["y", "z"]
    assert [r.request_id for r in sched.waiting] == ["x"]
    run_to_completion(sched, runner)
    assert_all_free(manager)


def test_chunked_prefill_splits_prompts_within_the_budget(managers):
    manager = managers(32)
    sched = make_scheduler(manager, max_num_batched_tokens=4)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 10)))
    sched.add_request(make_request("b", prompt(100, 3)))

    out, core = step(sched, runner)
    assert (out.num_scheduled_tokens, out.scheduled_new_reqs[0].block_ids) == ({"a": 4}, ([1],))
    assert core == []  # a mid-prompt chunk samples nothing
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 4}
    assert [(c.new_block_ids, c.num_computed_tokens) for c in out.scheduled_cached_reqs] == [
        (([2],), 4)]
    out, core = step(sched, runner)  # a's last 2 prompt tokens; b starts with the rest
    assert out.num_scheduled_tokens == {"a": 2, "b": 2}
    assert out.scheduled_cached_reqs[0].new_block_ids == ([3],)
    assert out.scheduled_new_reqs[0].block_ids == ([4],)
    assert [(o.req_id, o.new_token_ids) for o in core] == [("a", [10])]
    out, core = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert [(c.req_id, c.num_computed_tokens) for c in out.scheduled_cached_reqs] == [
        ("a", 10), ("b", 2)]
    assert [(o.req_id, o.new_token_ids) for o in core] == [("a", [11]), ("b", [103])]
    run_to_completion(sched, runner)
    assert_all_free(manager)


def test_without_chunking_a_prompt_waits_for_a_step_with_room(managers):
    manager = managers(32)
    sched = make_scheduler(manager, enable_chunked_prefill=False, max_num_batched_tokens=16,
                           max_model_len=16)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 10)))
    sched.add_request(make_request("b", prompt(100, 10)))
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 10}
    out, _ = step(sched, runner)
    assert out.num_scheduled_tokens == {"a": 1, "b": 10}
    run_to_completion(sched, runner)
    assert_all_free(manager)


def test_preemption_frees_the_latest_and_resumes_from_its_cached_prefix(managers):
    manager = managers(5)  # usable blocks 1..4
    sched = make_scheduler(manager)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 8), max_tokens=3))
    sched.add_request(make_request("b", prompt(100, 7), max_tokens=2))

    out, _ = step(sched, runner)
    assert [n.block_ids for n in out.scheduled_new_reqs] == [([1, 2],), ([3, 4],)]
    out, _ = step(sched, runner)  # a needs a 3rd block: b (the latest) gives back [4, 3]
    assert out.preempted_req_ids == {"b"}
    assert out.num_scheduled_tokens == {"a": 1}
    assert out.scheduled_cached_reqs[0].new_block_ids == ([4],)
    b = sched.requests["b"]
    assert (b.status, b.num_computed_tokens, b.num_preemptions) == (RequestStatus.PREEMPTED, 0, 1)
    assert [r.request_id for r in sched.waiting] == ["b"]

    out, core = step(sched, runner)  # b needs 2 blocks, only 1 is free: admission stops
    assert (out.num_scheduled_tokens, core[0].finish_reason) == ({"a": 1}, "length")
    out, core = step(sched, runner)  # b resumes: its first block is still cached
    assert out.finished_req_ids == {"a"}
    resumed = out.scheduled_new_reqs[0]
    assert (resumed.req_id, resumed.token_ids, resumed.num_prompt_tokens) == (
        "b", prompt(100, 8), 7)
    assert (resumed.block_ids, resumed.num_computed_tokens) == (([3, 4],), 4)
    assert out.num_scheduled_tokens == {"b": 4}
    assert [(o.req_id, o.new_token_ids, o.finish_reason) for o in core] == [
        ("b", [108], "length")]
    stats = sched.make_stats()
    assert stats.num_preemptions == 1 and sched.make_stats().num_preemptions == 0
    step(sched, runner)
    assert_all_free(manager)


def test_priority_preemption_takes_the_lowest_priority_even_if_scheduled(managers):
    manager = managers(5)
    sched = make_scheduler(manager, policy="priority")
    runner = FakeRunner()
    sched.add_request(make_request("low", prompt(0, 8), arrival=0.0, priority=5))
    sched.add_request(make_request("high", prompt(100, 8), arrival=1.0, priority=0))
    out, _ = step(sched, runner)
    assert new_ids(out) == ["high", "low"]
    # Running order is [high, low]; high is scheduled first and needs a block: low goes.
    out, _ = step(sched, runner)
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 1}
    assert out.scheduled_cached_reqs[0].new_block_ids == ([4],)
    sched.finish_requests(["high", "low"], RequestStatus.FINISHED_ABORTED)
    assert_all_free(manager)


def test_abort_running_and_waiting_requests(managers):
    manager = managers(16)
    sched = make_scheduler(manager, max_num_seqs=1)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 6)))
    sched.add_request(make_request("b", prompt(10, 6)))
    step(sched, runner)
    sched.finish_requests(["a", "b", "never-added"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_unfinished_requests() and sched.get_num_unfinished_requests() == 0
    assert_all_free(manager)
    out = sched.schedule()
    assert (out.finished_req_ids, out.is_empty) == ({"a", "b"}, True)
    with pytest.raises(ValueError, match="finished_status"):
        sched.finish_requests("a", RequestStatus.RUNNING)


def test_stop_conditions(managers):
    manager = managers(64)
    sched = make_scheduler(manager, max_model_len=12)
    runner = FakeRunner()
    cases = {
        "eos": dict(max_tokens=10),
        "ignore_eos": dict(max_tokens=3, ignore_eos=True),
        "min_tokens": dict(max_tokens=10, min_tokens=2),
        "stop_id": dict(max_tokens=10, stop_token_ids=[42]),
        "stop_id_early": dict(max_tokens=10, stop_token_ids=[42], min_tokens=2),
        "context": dict(max_tokens=None),
    }
    runner.script = {"eos": [5, EOS, 6], "ignore_eos": [EOS, EOS, 7],
                     "min_tokens": [EOS, EOS], "stop_id": [7, 42],
                     "stop_id_early": [42, 42, 9], "context": [1, 2, 3]}
    for name, params in cases.items():
        length = 10 if name == "context" else 8
        sched.add_request(make_request(name, prompt(0, length), **params))
    results = run_to_completion(sched, runner)
    assert results == {
        "eos": ([5, EOS], "stop"),
        "ignore_eos": ([EOS, EOS, 7], "length"),
        "min_tokens": ([EOS, EOS], "stop"),
        "stop_id": ([7, 42], "stop"),
        "stop_id_early": ([42, 42], "stop"),
        "context": ([1, 2], "length"),  # 10 prompt + 2 = max_model_len
    }
    assert_all_free(manager)


def test_stop_reason_reports_the_stop_token(managers):
    manager = managers(16)
    sched = make_scheduler(manager)
    runner = FakeRunner()
    runner.script = {"a": [42]}
    sched.add_request(make_request("a", prompt(0, 4), stop_token_ids=[42]))
    _, core = step(sched, runner)
    assert (core[0].finish_reason, core[0].stop_reason) == ("stop", 42)
    assert_all_free(manager)


def test_prefix_hit_shares_blocks_and_is_counted(managers):
    manager = managers(32)
    sched = make_scheduler(manager)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 10), max_tokens=1))
    step(sched, runner)
    sched.add_request(make_request("b", prompt(0, 10), max_tokens=1))
    out, core = step(sched, runner)
    hit = out.scheduled_new_reqs[0]
    assert (hit.block_ids, hit.num_computed_tokens) == (([1, 2, 4],), 8)
    assert out.num_scheduled_tokens == {"b": 2}
    assert core[0].num_cached_tokens == 8
    stats = sched.make_stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (20, 8)
    assert (stats.num_running, stats.num_waiting, stats.kv_cache_usage) == (0, 0, 0.0)
    assert_all_free(manager)


def test_admission_errors(managers):
    sched = make_scheduler(managers(8), max_waiting_requests=1)
    sched.add_request(make_request("a", prompt(0, 4)))
    with pytest.raises(ValueError, match="'a' is already"):
        sched.add_request(make_request("a", prompt(0, 4)))
    with pytest.raises(SchedulerQueueFullError, match="max_waiting_requests=1"):
        sched.add_request(make_request("b", prompt(0, 4)))


def test_request_without_sampling_params_stops_at_eos_or_context(managers):
    manager = managers(16)
    sched = make_scheduler(manager, max_model_len=6)
    runner = FakeRunner()
    runner.script = {"plain": [7, 8]}
    sched.add_request(Request("plain", prompt(0, 4), eos_token_id=EOS,
                              block_hasher=make_block_hasher(4)))
    assert run_to_completion(sched, runner) == {"plain": ([7, 8], "length")}
    assert_all_free(manager)


def test_hybrid_groups_free_window_blocks_and_report_both_tables(managers):
    manager = managers(32, sliding_window=4)
    sched = make_scheduler(manager, max_num_batched_tokens=8)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 12), max_tokens=2))
    out, _ = step(sched, runner)
    assert out.scheduled_new_reqs[0].block_ids == ([1, 2], [3, 4])
    out, core = step(sched, runner)
    assert [(c.new_block_ids, c.num_computed_tokens) for c in out.scheduled_cached_reqs] == [
        (([5], [6]), 8)]
    assert core[0].new_token_ids == [12]
    # Window 4 at token 8: block 3 (tokens 0..3) is out of the window, freed, and null now.
    assert manager.get_block_ids("a") == ([1, 2, 5], [0, 4, 6])
    out, core = step(sched, runner)
    assert out.scheduled_cached_reqs[0].new_block_ids == ([7], [8])
    assert (core[0].new_token_ids, core[0].finish_reason) == ([13], "length")
    assert_all_free(manager)


def test_a_request_the_cache_can_never_hold_ends_with_length(managers):
    # Before: it preempted itself and waited, at the head of the queue, for 5 blocks of a pool
    # of 4; every request behind it waited too.
    manager = managers(5)  # usable blocks 1..4: 16 tokens, while max_model_len is 64
    sched = make_scheduler(manager, max_num_seqs=1)
    runner = FakeRunner()
    sched.add_request(make_request("big", prompt(0, 10), max_tokens=20))
    sched.add_request(make_request("next", prompt(50, 3), max_tokens=2))
    results = run_to_completion(sched, runner)
    # 16 tokens computed, the 17th sampled; the 17th's slot is what could not be had.
    assert results == {"big": (prompt(10, 7), "length"), "next": ([53, 54], "length")}
    assert sched.requests == {}
    assert_all_free(manager)
