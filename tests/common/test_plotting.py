import sys

import pytest

from kvtier.common.plotting import require_matplotlib
from kvtier.entrypoints.cli import main


def test_a_plot_without_matplotlib_is_refused_before_the_run(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(ValueError, match=r"pip install 'kvtier\[bench\]'"):
        require_matplotlib()
    # A benchmark against nothing: the refusal comes before any request is sent.
    status = main(["bench", "multi-turn", "--url", "http://127.0.0.1:9", "--output-plot",
                   str(tmp_path / "plot.png")])
    assert status != 0
    assert "--output-plot needs matplotlib" in capsys.readouterr().err
