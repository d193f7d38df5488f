"""Connector loads on hybrid models: a sliding-window (window 8) or recurrent-state group beside
full attention keeps only some blocks, so what it holds after an external hit decides where the
request may resume, and a load may only end on a block boundary."""

import pytest

from kvtier.connector.base import KVConnectorOutput
from kvtier.kv import RequestStatus

from .sched_fakes import (
    FakeRunner,
    ScriptedConnector,
    assert_all_free,
    make_request,
    make_scheduler,
    prompt,
    step,
)

KINDS = {"window": {"sliding_window": 8}, "state": {"recurrent_state": True}}


def cache_prefix(sched, runner):
    """Request "p" computes and caches prompt(0, 8): group 0 blocks 1-2, group 1 blocks 4-5."""
    sched.add_request(make_request("p", prompt(0, 8) + [50], max_tokens=1))
    step(sched, runner)
    step(sched, runner)


@pytest.mark.parametrize("kind", KINDS)
def test_a_load_past_the_window_takes_no_hit_blocks_it_skips(managers, kind):
    manager = managers(40, **KINDS[kind])
    sched = make_scheduler(manager, ScriptedConnector(answers={"b": [(24, False)]}),
                           kv_load_failure_policy="recompute")
    runner = FakeRunner()
    cache_prefix(sched, runner)
    sched.add_request(make_request("b", prompt(0, 8) + prompt(100, 28), max_tokens=2))
    out = sched.schedule()  # 8 local + 24 loaded: group 1 keeps only blocks after token 32
    attention, group1 = manager.get_block_ids("b")
    assert attention == [1, 2, 7, 8, 9, 10, 11, 12, 13]
    assert group1 == ([0] * 6 + [14, 15, 16] if kind == "window" else [0] * 7 + [14, 15])
    assert (manager.block_pool.blocks[4].ref_cnt, manager.block_pool.blocks[5].ref_cnt) == (0, 0)
    # Tokens 8..11 arrive bad: group 1 holds no blocks to recompute them in.
    core = sched.update_from_output(out, runner.execute(
        out, KVConnectorOutput(invalid_block_ids={7})))
    assert core == []
    b = sched.requests["b"]
    assert (b.status, b.num_computed_tokens) == (RequestStatus.RUNNING, 0)
    assert manager.get_block_ids("b") == ([], [])
    out, core = step(sched, runner)  # rebuilt from token 0 in fresh blocks
    new = out.scheduled_new_reqs[0]
    assert (out.preempted_req_ids, new.num_computed_tokens) == ({"b"}, 0)
    assert out.num_scheduled_tokens == {"b": 36}
    first = 17 if kind == "window" else 16  # the first blocks no request has used yet
    assert new.block_ids == (list(range(first, first + 9)), list(range(first + 9, first + 18)))
    assert [o.new_token_ids for o in core] == [[128]]
    step(sched, runner)
    assert_all_free(manager)


@pytest.mark.parametrize("kind", KINDS)
def test_a_failed_async_load_past_the_window_starts_over_from_the_local_hit(managers, kind):
    manager = managers(40, **KINDS[kind])
    connector = ScriptedConnector(answers={"b": [(24, True)]})
    sched = make_scheduler(manager, connector, kv_load_failure_policy="recompute")
    runner = FakeRunner()
    cache_prefix(sched, runner)
    sched.add_request(make_request("b", prompt(0, 8) + prompt(100, 28), max_tokens=1))
    step(sched, runner)
    assert manager.get_block_ids("b") == (
        [1, 2, 7, 8, 9, 10, 11, 12],
        [0] * 6 + [13, 14] if kind == "window" else [0] * 7 + [13])
    step(sched, runner, KVConnectorOutput(finished_recving={"b"}, invalid_block_ids={7}))
    assert sched.requests["b"].num_computed_tokens == 0  # no resuming at 8 over null blocks
    out, core = step(sched, runner)  # a newcomer again: the local hit, then compute
    new = out.scheduled_new_reqs[0]
    assert (new.num_computed_tokens, out.num_scheduled_tokens) == (8, {"b": 28})
    first = 15 if kind == "window" else 14  # the first blocks no request has used yet
    assert new.block_ids == (
        [1, 2] + list(range(first, first + 7)),
        ([4, 5] if kind == "window" else [0, 5]) + list(range(first + 7, first + 14)))
    assert connector.queries == [("p", 0), ("b", 8)]  # b is not asked again
    assert core[0].finish_reason == "length"
    assert_all_free(manager)


@pytest.mark.parametrize("kind", KINDS)
def test_a_whole_prompt_load_stops_at_the_last_block_boundary(managers, kind):
    manager = managers(40, **KINDS[kind])
    connector = ScriptedConnector(answers={"a": [(16, True)]})
    sched = make_scheduler(manager, connector)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 16), max_tokens=1))
    step(sched, runner)
    # Cut to 15 after landing, the state group would resume on the state after 16 tokens.
    assert connector.allocs == [("a", [1, 2, 3], 12)]
    assert sched.requests["a"].num_computed_tokens == 12
    step(sched, runner, KVConnectorOutput(finished_recving={"a"}))
    out, core = step(sched, runner)
    new = out.scheduled_new_reqs[0]
    assert (new.num_computed_tokens, out.num_scheduled_tokens) == (12, {"a": 4})
    if kind == "window":  # tokens 0..3 are outside the window of token 12
        assert new.block_ids == ([1, 2, 3, 6], [0, 4, 5, 7])
    else:  # the state after 12 tokens, in block 4
        assert new.block_ids == ([1, 2, 3, 5], [0, 0, 4, 6])
    assert core[0].new_token_ids == [16]
    assert_all_free(manager)


@pytest.mark.parametrize("kind", KINDS)
def test_a_synchronous_load_is_cut_to_a_block_boundary(managers, kind):
    manager = managers(40, **KINDS[kind])
    connector = ScriptedConnector(answers={"a": [(10, False)]})
    sched = make_scheduler(manager, connector)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 16), max_tokens=1))
    out, core = step(sched, runner)
    assert connector.allocs == [("a", [1, 2, 3, 4], 8)]
    new = out.scheduled_new_reqs[0]
    assert (new.num_computed_tokens, out.num_scheduled_tokens) == (8, {"a": 8})
    assert core[0].new_token_ids == [16]
    assert_all_free(manager)
