"""use_one_cpu_thread: a thread other than the engine's runs torch ops without an OpenMP team
of its own, and leaves every other thread's setting alone."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from kvtier.common.cpu_threads import _torch_openmp, use_one_cpu_thread

pytestmark = pytest.mark.skipif(_torch_openmp() is None, reason="torch does not use OpenMP here")


@pytest.fixture(autouse=True)
def two_threads():
    """The worker tests' conftest makes torch single-threaded; these need a team to exist."""
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def _num_os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def _in_thread(fn):
    """Runs fn on a new thread that stays alive (as executor threads do) until released."""
    result, done, release = {}, threading.Event(), threading.Event()

    def body():
        result["value"] = fn()
        done.set()
        release.wait(30)

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    assert done.wait(30)
    return result["value"], thread, release


def _parallel_op_then_count() -> tuple[int, int]:
    before = _num_os_threads()
    x = torch.ones(4_000_000)
    x.mul_(2.0)  # far above torch's grain size: parallel when the thread may use a team
    assert float(x[-1]) == 2.0
    return before, _num_os_threads()


def test_a_thread_that_uses_one_cpu_thread_starts_no_openmp_team():
    def single():
        use_one_cpu_thread()
        return torch.get_num_threads(), _parallel_op_then_count()

    (count, (before, after)), thread, release = _in_thread(single)
    try:
        assert count == 1
        assert after == before
    finally:
        release.set()
        thread.join(30)


def test_without_it_the_same_op_starts_a_team_that_outlives_the_op():
    # The failure the helper exists for: the team's workers stay as long as the thread does.
    (before, after), thread, release = _in_thread(_parallel_op_then_count)
    try:
        assert after > before
    finally:
        release.set()
        thread.join(30)


def test_other_threads_keep_their_thread_count():
    main_count = torch.get_num_threads()
    _, thread, release = _in_thread(use_one_cpu_thread)
    try:
        assert torch.get_num_threads() == main_count == 2
        (fresh, _), fresh_thread, fresh_release = _in_thread(
            lambda: (torch.get_num_threads(), None))
        fresh_release.set()
        fresh_thread.join(30)
        assert fresh == main_count
    finally:
        release.set()
        thread.join(30)
