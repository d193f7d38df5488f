"""The fault suite: every fault kvtier promises to survive, run with `-m faults` (in CI, not in
the default run). Each test here is marked `faults` by this folder, except the soak run
(`-m soak`, about 20 minutes, not in CI)."""

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "/tests/faults/" in str(item.fspath) and item.get_closest_marker("soak") is None:
            item.add_marker(pytest.mark.faults)
