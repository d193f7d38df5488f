"""`kvtier serve` argument checks that fail before any model is loaded."""

from __future__ import annotations

import pytest

from kvtier.entrypoints.cli import main


@pytest.mark.parametrize("value", ["0", "-0.001", "2"])
def test_switch_interval_out_of_range_is_a_one_line_error(value, capsys):
    assert main(["serve", "--switch-interval", value]) != 0
    err = capsys.readouterr().err.strip()
    assert err == ("kvtier serve: error: --switch-interval must be in (0, 1] seconds, "
                   f"got {float(value)}")
