import pytest

from kvtier.sched import FCFSRequestQueue, PriorityRequestQueue, create_request_queue

from .sched_fakes import make_request


def ids(queue):
    return [r.request_id for r in queue]


def test_fcfs_order_prepend_and_remove():
    queue = FCFSRequestQueue()
    a, b, c, d = (make_request(name, [1, 2]) for name in "abcd")
    for request in (a, b, c):
        queue.add_request(request)
    assert queue.pop_request() is a
    queue.prepend_requests([a, d])
    assert ids(queue) == ["a", "d", "b", "c"]
    queue.remove_requests([d, make_request("x", [1])])
    assert ids(queue) == ["a", "b", "c"]
    assert queue.peek_request() is a and len(queue) == 3


def test_priority_order_breaks_ties_by_arrival():
    queue = PriorityRequestQueue()
    late_urgent = make_request("late_urgent", [1], arrival=5.0, priority=-1)
    early = make_request("early", [1], arrival=1.0, priority=0)
    later = make_request("later", [1], arrival=2.0, priority=0)
    lazy = make_request("lazy", [1], arrival=0.0, priority=3)
    for request in (lazy, later, early, late_urgent):
        queue.add_request(request)
    assert ids(queue) == ["late_urgent", "early", "later", "lazy"]
    assert queue.pop_request() is late_urgent
    queue.prepend_request(late_urgent)
    queue.remove_requests([early])
    assert [queue.pop_request().request_id for _ in range(3)] == ["late_urgent", "later", "lazy"]
    with pytest.raises(IndexError):
        queue.peek_request()


def test_create_request_queue_rejects_unknown_policy():
    assert isinstance(create_request_queue("fcfs"), FCFSRequestQueue)
    with pytest.raises(ValueError, match="policy"):
        create_request_queue("random")
