"""Runs an offline benchmark's vLLM side: the same benchmark file under the peer's interpreter
(`--engine vllm`), which writes its result as JSON to a file (vLLM prints its own lines to
stdout, even at shutdown)."""

from __future__ import annotations

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
