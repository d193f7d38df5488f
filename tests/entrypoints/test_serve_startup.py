"""What `kvtier serve` does between building the engine and serving."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Runs `kvtier serve` with uvicorn's serving loop replaced by a report of the collector's state
# at that moment, then stops the engine thread (a daemon) by exiting.
_PROBE = """
import gc, sys, uvicorn
from kvtier.entrypoints.cli import main
def report(server):
    print("frozen", gc.get_freeze_count(), "tracked", len(gc.get_objects()), flush=True)
uvicorn.Server.run = report
code = main(["serve", *sys.argv[1:]])
import os; os._exit(code)
"""


def test_serve_freezes_its_startup_objects_before_serving(tiny_model):
    """The objects startup made are out of the cyclic collector's reach when serving starts, so
    a full collection in the middle of serving does not walk them (~150-270 ms for the default
    model). Fails if serve no longer freezes them."""
    result = subprocess.run(
        [sys.executable, "-c", _PROBE, tiny_model[0], "--num-device-blocks", "64",
         "--max-model-len", "256", "--port", "1"],
        env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("frozen"))
    _, frozen, _, tracked = line.split()
    # torch, the model and the app alone are tens of thousands of objects; nearly everything
    # alive is frozen, the rest is what the probe itself made since.
    assert int(frozen) > 10_000
    assert int(tracked) < int(frozen) // 10
