"""The C++ kernels' build never holds a process forever: torch waits for its build lock with
no end, so a lock left by a process killed mid-build is removed once older than a build can
take, and a wait for a lock (or a build) past the deadline gives up for the torch path."""

import logging
import os
import time

import pytest

from kvtier.models import cpu_kernels


@pytest.fixture
def build_dir(tmp_path, monkeypatch):
    """An empty extensions root and no kernels loaded yet in this process."""
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernels, "_loaded", {})
    directory = tmp_path / cpu_kernels._build_name()
    directory.mkdir()
    return directory


def test_a_build_lock_that_is_not_released_ends_in_the_torch_path(build_dir, monkeypatch,
                                                                  caplog):
    monkeypatch.setattr(cpu_kernels, "BUILD_DEADLINE_S", 1.0)
    (build_dir / "lock").touch()  # a build elsewhere that never ends
    started = time.monotonic()
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels.ops() is None
    assert time.monotonic() - started < 10
    assert str(build_dir / "lock") in caplog.text
    assert (build_dir / "lock").exists()  # young: not ours to remove


def test_a_lock_older_than_a_build_can_take_is_removed(build_dir, caplog):
    lock = build_dir / "lock"
    lock.touch()
    old = time.time() - cpu_kernels.BUILD_DEADLINE_S - 60
    os.utime(lock, (old, old))
    with caplog.at_level(logging.WARNING, logger=cpu_kernels.__name__):
        assert cpu_kernels._remove_stale_lock(build_dir.name) == str(lock)
    assert not lock.exists()
    assert "did not finish" in caplog.text
