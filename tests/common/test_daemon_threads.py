"""DaemonThreadPool: futures like an executor's, a shutdown that never waits past its deadline."""

import threading
import time

import pytest

from kvtier.common.daemon_threads import DaemonThreadPool


def test_results_exceptions_and_queued_calls_at_shutdown():
    pool = DaemonThreadPool(1, "test-pool")
    gate = threading.Event()
    first = pool.submit(gate.wait, 10)
    queued = [pool.submit(pow, 2, n) for n in range(3)]
    failing = pool.submit(int, "x")
    gate.set()
    assert pool.shutdown(10)  # queued calls still run
    assert first.result() is True
    assert [f.result() for f in queued] == [1, 2, 4]
    with pytest.raises(ValueError, match="invalid literal"):
        failing.result()
    with pytest.raises(RuntimeError, match="'test-pool' is shut down"):
        pool.submit(pow, 2, 2)


def test_a_stuck_call_is_abandoned_at_the_deadline(caplog):
    pool = DaemonThreadPool(2, "stuck-pool")
    gate = threading.Event()
    stuck = pool.submit(gate.wait, 30)
    time.sleep(0.05)  # the stuck call is running
    later = [pool.submit(pow, 2, 2) for _ in range(4)]
    start = time.monotonic()
    try:
        assert pool.shutdown(0.2, cancel_pending=True) is False
        assert time.monotonic() - start < 0.2 + 5
        threads = [t for t in threading.enumerate() if t.name.startswith("stuck-pool")]
        assert len(threads) == 1 and threads[0].daemon  # never joined past the deadline
        assert not stuck.done()
        assert all(f.cancelled() or f.result() == 4 for f in later)
        assert "1 thread(s) of stuck-pool still busy 0.2 s into shutdown" in caplog.text
    finally:
        gate.set()
