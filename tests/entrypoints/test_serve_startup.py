"""What `kvtier serve` does between building the engine and serving, and how it ends."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

from ..tiny_models import hf_greedy
from .server_process import ServerProcess

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


def test_the_models_generation_config_sets_the_sampling_defaults(tiny_model, tmp_path):
    """A request that leaves temperature and repetition_penalty unset gets the model's
    generation_config.json values (HF's greedy with that penalty is the reference); one that
    sets them gets its own; --generation-config vllm ignores the file."""
    import httpx
    import torch

    from .server_process import ServerProcess

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model[0], model_dir)
    config = json.loads((model_dir / "generation_config.json").read_text())
    config.update(temperature=0.0, repetition_penalty=3.0)
    (model_dir / "generation_config.json").write_text(json.dumps(config))
    prompt = [5, 6, 7, 8, 9, 10]
    with torch.no_grad():
        generated = tiny_model[1].generate(torch.tensor([prompt]), max_new_tokens=24,
                                           min_new_tokens=24, do_sample=False, pad_token_id=0,
                                           repetition_penalty=3.0)
    penalized = generated[0, len(prompt):].tolist()
    plain = hf_greedy(tiny_model[1], [prompt], 24)[0]
    assert penalized != plain

    def tokens(server, **fields) -> list[int]:
        body = {"prompt": prompt, "max_tokens": 24, "ignore_eos": True, "return_token_ids": True,
                **fields}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60.0)
        assert response.status_code == 200, response.text
        return response.json()["choices"][0]["token_ids"]

    server = ServerProcess(str(model_dir), "--num-device-blocks", "64", "--max-model-len", "256")
    try:
        assert tokens(server) == penalized
        assert tokens(server, temperature=0.0, repetition_penalty=1.0) == plain
    finally:
        server.stop()
    server = ServerProcess(str(model_dir), "--num-device-blocks", "64", "--max-model-len", "256",
                           "--generation-config", "vllm")
    try:
        assert tokens(server, temperature=0.0) == plain
    finally:
        server.stop()


def test_ctrl_c_exits_130_also_when_started_with_sigint_ignored(tiny_model):
    """A shell starts a background job with SIGINT ignored; uvicorn still stops on it, and its
    exit status says so (it once re-raised the signal under the inherited SIG_IGN: exit 0)."""
    server = ServerProcess(tiny_model[0], sigint_ignored=True)
    try:
        server.process.send_signal(signal.SIGINT)
        assert server.process.wait(60) == 130
    finally:
        server.stop()
