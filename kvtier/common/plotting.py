"""Plots are optional: matplotlib comes with the bench extra only."""

from __future__ import annotations

import importlib.util


def require_matplotlib(flag: str = "--output-plot") -> None:
    """ValueError naming the fix when matplotlib is missing; call it before the work whose
    result is plotted, not after."""
    if importlib.util.find_spec("matplotlib") is None:
        raise ValueError(f"{flag} needs matplotlib, which is not installed: "
                         "pip install 'kvtier[bench]'")
