"""Requests whose KV load landed go on ahead of the waiting queue's newcomers.

Admissions keep free the blocks that loading requests still need. A newcomer ahead of them in
the queue that does not fit beside that reserve must not hold them back: with nothing running,
neither would ever start (seen under load: the host tier full, a request at the head deferred
while its chunks came up from disk, the requests behind it admitted with loads).
"""

from kvtier.kv import RequestStatus

from .sched_fakes import (
    FakeRunner,
    ScriptedConnector,
    assert_all_free,
    make_request,
    make_scheduler,
    prompt,
    run_to_completion,
    step,
)
from .test_scheduler_connector import recv


def test_a_landed_load_behind_a_newcomer_that_waits_for_its_reserve_goes_first(managers):
    manager = managers(8)  # usable blocks 1..7
    # a's KV is on its way up from a slower tier (None) when b is asked; then a is a miss.
    connector = ScriptedConnector(answers={"a": [(None, False), (0, False)], "b": [(8, True)]})
    sched = make_scheduler(manager, connector)
    runner = FakeRunner()
    a = make_request("a", prompt(0, 16), max_tokens=1)
    b = make_request("b", prompt(100, 16), max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    out, _ = step(sched, runner)  # a deferred, b loads 8 tokens into blocks 1, 2
    assert out.is_empty and connector.allocs == [("b", [1, 2], 8)]
    assert [r.request_id for r in sched.waiting] == ["a", "b"]
    # b's load lands. a needs 4 blocks; 5 are free, but b still needs 2 of them.
    out, _ = step(sched, runner, recv("b"))
    assert out.is_empty and a.status == RequestStatus.WAITING
    out, _ = step(sched, runner)  # b goes on from its loaded blocks, ahead of a
    assert [(new.req_id, new.block_ids) for new in out.scheduled_new_reqs] == [
        ("b", ([1, 2, 3, 4],))]
    results = run_to_completion(sched, runner)
    assert results["a"][1] == "length"
    assert_all_free(manager)


def test_a_landed_load_that_does_not_fit_yet_keeps_its_reserve(managers):
    """A landed load waiting for a running request's blocks keeps them reserved: a newcomer
    admitted into them would leave it waiting again."""
    manager = managers(10)  # usable blocks 1..9
    connector = ScriptedConnector(answers={"b": [(8, True)]})
    sched = make_scheduler(manager, connector, max_num_seqs=2)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 8), max_tokens=12))
    b = make_request("b", prompt(100, 24), max_tokens=1)
    sched.add_request(b)
    step(sched, runner)  # a runs in 2 blocks, b loads 8 of its 24 tokens into 2 more
    assert connector.allocs[-1] == ("b", [3, 4], 8)
    for _ in range(8):  # a decodes into 2 more blocks: b's 4 missing ones no longer fit
        step(sched, runner)
    sched.add_request(make_request("c", prompt(200, 4), max_tokens=1))
    step(sched, runner, recv("b"))
    out, _ = step(sched, runner)  # b's load landed, but only 2 blocks are free
    assert manager.num_free_blocks == 2 and b.status == RequestStatus.WAITING
    assert out.scheduled_new_reqs == []  # c (1 block) would take one of b's
    results = run_to_completion(sched, runner)
    assert {name: reason for name, (_, reason) in results.items()} == {
        "a": "length", "b": "length", "c": "length"}
    assert_all_free(manager)
