"""A step that raised: what the engine drops from the prefix cache (uncache_failed_step), and
the connector lookup deadline of requests that keep waiting."""

from kvtier.kv import RequestStatus

from .sched_fakes import (
    Clock,
    FakeRunner,
    ScriptedConnector,
    assert_all_free,
    make_request,
    make_scheduler,
    prompt,
    step,
)


def probe_hit(manager, tokens):
    return manager.get_computed_blocks(make_request("probe", tokens))[1]


def test_a_failed_step_uncaches_the_blocks_of_its_synchronous_loads(managers):
    manager = managers(20)
    connector = ScriptedConnector(answers={"a": [(8, False)]})
    sched = make_scheduler(manager, connector)
    runner = FakeRunner()
    sched.add_request(make_request("p", prompt(0, 4) + [50], max_tokens=1))
    step(sched, runner)
    step(sched, runner)  # p cached tokens 0..3 in block 1
    sched.add_request(make_request("a", prompt(0, 17), max_tokens=4))
    out = sched.schedule()  # 4 local, 8 loaded during the step (cached now), 5 computed
    assert connector.allocs[-1] == ("a", [1, 3, 4, 5, 6], 8)
    assert (out.num_scheduled_tokens, out.num_external_computed_tokens) == ({"a": 5}, {"a": 8})
    assert probe_hit(manager, prompt(0, 17)) == 16
    # The runner raised (e.g. in start_load_kv): nothing was loaded or computed.
    sched.failures.uncache_failed_step(out)
    sched.finish_requests("a", RequestStatus.FINISHED_ABORTED)
    assert probe_hit(manager, prompt(0, 17)) == 4  # the local hit stays valid
    assert_all_free(manager)


def test_a_count_from_the_connector_restarts_its_lookup_deadline(managers):
    manager = managers(8)  # usable blocks 1..7
    clock = Clock()
    connector = ScriptedConnector(answers={
        "b": [(None, False), (8, False), (8, False), (None, False), (8, False)]})
    sched = make_scheduler(manager, connector, clock, kv_load_timeout_s=60.0)
    runner = FakeRunner()
    sched.add_request(make_request("a", prompt(0, 16), max_tokens=10))
    step(sched, runner)  # a holds 5 blocks: b does not fit beside it
    sched.add_request(make_request("b", prompt(100, 16), max_tokens=1))
    for now in (0.0, 1.0, 2.0, 61.0):  # not yet, 8, 8 (no room), not yet
        clock.now = now
        out, _ = step(sched, runner)
        assert list(out.num_scheduled_tokens) == ["a"]
    assert "b" not in sched.no_external_load  # one "not yet" is no missed deadline
    assert sched.make_stats().num_connector_lookup_timeouts == 0
    for _ in range(8):
        step(sched, runner)
    assert connector.allocs[-1] == ("b", [7, 6, 5, 4], 8)  # admitted with its load, in a's blocks
    step(sched, runner)
    assert_all_free(manager)
