from __future__ import annotations

import numpy as np
import pytest

from kvtier.common.token_ids import all_ints, first_outside


@pytest.mark.parametrize("values, expected", [
    ([1, 2, 3], True), ([], True), ([1, "2"], False), ([1, 2.0], False), ([1, True], False),
    ([np.int64(1)], False), ([[1], 2], False)])
def test_all_ints(values, expected):
    assert all_ints(values) is expected


@pytest.mark.parametrize("ids, expected", [
    ([0, 5, 9], None), ([], None), ([3, 10, -1], 10), ([3, -1, 10], -1), ([10**12], 10**12)])
def test_first_outside_names_the_first_id_not_in_range(ids, expected):
    assert first_outside(ids, 10) == expected
